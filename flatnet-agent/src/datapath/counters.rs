//! Reading the uplink ARP/NDP frame counters.

use std::path::Path;

use aya::maps::{Map, MapData, PerCpuArray};
use flatnet_common::{FrameCounter, FrameKind, pin::MAP_FRAME_COUNTERS};
use serde::Serialize;

use super::{DatapathError, map_pin_path};

/// Uplink frame counters per [`FrameKind`], summed over CPUs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FrameCounters {
    counters: [Counter; FrameKind::COUNT as usize],
}

/// One kind's totals, as shown to users.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Counter {
    /// Frames seen.
    pub packets: u64,
    /// Bytes seen.
    pub bytes: u64,
}

impl FrameCounters {
    /// Reads the counters from a loaded map.
    pub fn read(map: &Map) -> Result<Self, DatapathError> {
        let array = PerCpuArray::<_, FrameCounter>::try_from(map).map_err(map_error)?;
        Self::sum(&array)
    }

    /// Reads the counters from the map pinned under `pin_root`, without
    /// loading any program (for inspection by a second process).
    pub fn read_pinned(pin_root: &Path) -> Result<Self, DatapathError> {
        let data =
            MapData::from_pin(map_pin_path(pin_root, MAP_FRAME_COUNTERS)).map_err(map_error)?;
        let map = Map::PerCpuArray(data);
        Self::read(&map)
    }

    fn sum<T: std::borrow::Borrow<MapData>>(
        array: &PerCpuArray<T, FrameCounter>,
    ) -> Result<Self, DatapathError> {
        let mut totals = Self::default();
        for kind in FrameKind::ALL {
            let per_cpu = array.get(&kind.index(), 0).map_err(map_error)?;
            let sum = per_cpu
                .iter()
                .fold(FrameCounter::default(), |acc, c| acc.merged(*c));
            totals.counters[kind.index() as usize] = Counter {
                packets: sum.packets,
                bytes: sum.bytes,
            };
        }
        Ok(totals)
    }

    /// The totals of one kind.
    pub fn get(&self, kind: FrameKind) -> Counter {
        self.counters[kind.index() as usize]
    }

    /// `(kind, totals)` for every kind, in index order.
    pub fn iter(&self) -> impl Iterator<Item = (FrameKind, Counter)> + '_ {
        FrameKind::ALL.iter().map(|&k| (k, self.get(k)))
    }
}

impl Serialize for FrameCounters {
    /// A JSON object keyed by [`FrameKind::name`].
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut map = serializer.serialize_map(Some(FrameKind::COUNT as usize))?;
        for (kind, counter) in self.iter() {
            map.serialize_entry(kind.name(), &counter)?;
        }
        map.end()
    }
}

fn map_error(source: aya::maps::MapError) -> DatapathError {
    DatapathError::Map {
        map: MAP_FRAME_COUNTERS,
        source,
    }
}
