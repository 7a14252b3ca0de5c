//! Whether the maps pinned by an earlier agent still fit the embedded object.
//!
//! aya adopts whatever map is pinned at a map's path without looking at it.
//! After an upgrade that changed a map's layout (a value grew, a table got
//! more entries), the new programs would then be verified against, or
//! silently misread, a map of the old shape. So before loading, every
//! existing pin is compared with the map the object defines, as aya will
//! create it; a pin that differs is removed and the loader creates and pins
//! a fresh, empty map in its place. Pins that fit are adopted as before, so
//! a plain restart keeps all state.

use std::{
    collections::HashMap,
    fmt, io,
    path::{Path, PathBuf},
};

use aya::maps::{MapError, MapInfo};
use aya_obj::generated::{BPF_F_RDONLY, BPF_F_WRONLY, bpf_map_type};
use flatnet_common::pin::{
    MAP_ARP_RESPONDER, MAP_CONFLICT_EVENTS, MAP_FRAME_COUNTERS, MAP_MANAGED_ADDRS,
    MAP_NDP_RESPONDER, MAP_NODE_MACS, MAP_POLICY_CIDRS, MAP_POLICY_CT, MAP_POLICY_EVENT_BUDGET,
    MAP_POLICY_EVENTS, MAP_POLICY_FRAGS, MAP_POLICY_RULE_STATS, MAP_POLICY_STATS,
    MAP_POLICY_SUBJECTS, MAP_RECENT_CONFLICTS, MAP_RESOLVE_WATCH, MAP_RESOLVERS,
    MAP_RESPONDER_STATS, MAP_WIRE_CLAIMS,
};

use super::DatapathError;

/// The shape of a map as the kernel reports it (`bpf_map_info`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct MapLayout {
    /// `BPF_MAP_TYPE_*`.
    pub map_type: u32,
    /// Key size in bytes.
    pub key_size: u32,
    /// Value size in bytes.
    pub value_size: u32,
    /// Capacity (bytes for a ring buffer).
    pub max_entries: u32,
    /// `BPF_F_*` creation flags.
    pub flags: u32,
}

/// One way two layouts differ.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum LayoutField {
    MapType,
    KeySize,
    ValueSize,
    MaxEntries,
    Flags,
}

/// Page size and possible CPUs: the host facts aya sizes some maps by.
#[derive(Clone, Copy, Debug)]
struct HostSizes {
    page_size: u32,
    possible_cpus: u32,
}

impl MapLayout {
    fn of_pin(info: &MapInfo) -> Result<Self, MapError> {
        Ok(Self {
            map_type: info.map_type()? as u32,
            key_size: info.key_size(),
            value_size: info.value_size(),
            max_entries: info.max_entries(),
            flags: info.map_flags(),
        })
    }

    /// The layout of the map aya 0.14 creates for `map`, adjusted the way
    /// its loader (`EbpfLoader::load`) adjusts definitions: otherwise an
    /// unchanged ring buffer would look different at every restart and be
    /// replaced, losing state for nothing.
    fn as_created(map: &aya_obj::Map, host: HostSizes) -> Self {
        let mut layout = Self {
            map_type: map.map_type(),
            key_size: map.key_size(),
            value_size: map.value_size(),
            max_entries: map.max_entries(),
            // The kernel keeps these access flags on the creating file
            // descriptor, not on the map, so a pin never reports them.
            flags: map.map_flags() & !(BPF_F_RDONLY | BPF_F_WRONLY),
        };
        if layout.map_type == bpf_map_type::BPF_MAP_TYPE_RINGBUF as u32 {
            // The value type only documents the records; the kernel's ring
            // buffer is sized in bytes, a power-of-two number of pages.
            layout.value_size = 0;
            layout.max_entries = ring_bytes(layout.max_entries, host.page_size);
        }
        if layout.map_type == bpf_map_type::BPF_MAP_TYPE_PERF_EVENT_ARRAY as u32
            && layout.max_entries == 0
        {
            layout.max_entries = host.possible_cpus;
        }
        layout
    }
}

impl fmt::Display for MapLayout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match bpf_map_type::try_from(self.map_type) {
            Ok(map_type) => write!(f, "{map_type:?}")?,
            Err(_) => write!(f, "map type {}", self.map_type)?,
        }
        write!(
            f,
            ", key {} B, value {} B, {} entries, flags {:#x}",
            self.key_size, self.value_size, self.max_entries, self.flags
        )
    }
}

/// How `pinned` differs from `expected`; empty when the pin can be adopted.
///
/// Device and CPU maps are the exception aya makes: it picks their value
/// size from kernel feature probes, so only their other fields count.
pub(super) fn differences(pinned: &MapLayout, expected: &MapLayout) -> Vec<LayoutField> {
    let value_size_probed = [
        bpf_map_type::BPF_MAP_TYPE_CPUMAP,
        bpf_map_type::BPF_MAP_TYPE_DEVMAP,
        bpf_map_type::BPF_MAP_TYPE_DEVMAP_HASH,
    ]
    .iter()
    .any(|&t| expected.map_type == t as u32);
    [
        (LayoutField::MapType, pinned.map_type != expected.map_type),
        (LayoutField::KeySize, pinned.key_size != expected.key_size),
        (
            LayoutField::ValueSize,
            pinned.value_size != expected.value_size && !value_size_probed,
        ),
        (
            LayoutField::MaxEntries,
            pinned.max_entries != expected.max_entries,
        ),
        (LayoutField::Flags, pinned.flags != expected.flags),
    ]
    .into_iter()
    .filter_map(|(field, differs)| differs.then_some(field))
    .collect()
}

/// Removes every pin in `pins` (map name, pin path) whose map no longer
/// fits the definition in `object`, so the loader creates a fresh one.
pub(super) fn remove_incompatible_pins(
    object: &[u8],
    pins: &[(&'static str, PathBuf)],
) -> Result<(), DatapathError> {
    let mut expected = expected_layouts(object, host_sizes()?)?;
    for &(map, ref path) in pins {
        if !pin_exists(map, path)? {
            continue;
        }
        let expected = expected.remove(map).ok_or(DatapathError::MissingMap(map))?;
        let inspect_error = |source| DatapathError::InspectPin {
            map,
            path: path.clone(),
            source: Box::new(source),
        };
        let pinned = MapInfo::from_pin(path)
            .and_then(|info| MapLayout::of_pin(&info))
            .map_err(inspect_error)?;
        if differences(&pinned, &expected).is_empty() {
            continue;
        }
        std::fs::remove_file(path).map_err(|source| DatapathError::PinFile {
            map,
            path: path.clone(),
            source,
        })?;
        // As strings, so text logs quote them like the other fields.
        let (old, new) = (pinned.to_string(), expected.to_string());
        tracing::warn!(
            map,
            path = %path.display(),
            old = old.as_str(),
            new = new.as_str(),
            lost = state_lost(map),
            "the pinned map has another layout than this agent's programs expect; \
             replacing it with an empty map"
        );
    }
    Ok(())
}

/// The layout of each map in `object` once aya has created it.
fn expected_layouts(
    object: &[u8],
    host: HostSizes,
) -> Result<HashMap<String, MapLayout>, DatapathError> {
    let object = aya_obj::Object::parse(object).map_err(DatapathError::Object)?;
    Ok(object
        .maps
        .iter()
        .map(|(name, map)| (name.clone(), MapLayout::as_created(map, host)))
        .collect())
}

fn host_sizes() -> Result<HostSizes, DatapathError> {
    // SAFETY: sysconf reads a constant of the running system.
    let page_size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    let possible_cpus = aya::util::nr_cpus().map_err(|(path, error)| {
        DatapathError::Io(io::Error::new(error.kind(), format!("{path}: {error}")))
    })?;
    Ok(HostSizes {
        page_size: u32::try_from(page_size).unwrap_or(4096),
        possible_cpus: u32::try_from(possible_cpus).unwrap_or(u32::MAX),
    })
}

fn pin_exists(map: &'static str, path: &Path) -> Result<bool, DatapathError> {
    match std::fs::symlink_metadata(path) {
        Ok(_) => Ok(true),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
        Err(source) => Err(DatapathError::PinFile {
            map,
            path: path.to_path_buf(),
            source,
        }),
    }
}

/// The ring buffer size aya asks the kernel for: `bytes` rounded up to a
/// power-of-two number of pages (as libbpf does).
fn ring_bytes(bytes: u32, page_size: u32) -> u32 {
    if bytes == 0 || page_size == 0 {
        return bytes;
    }
    page_size.saturating_mul(bytes.div_ceil(page_size).next_power_of_two())
}

/// What replacing `map` with an empty one costs, for the operator.
fn state_lost(map: &str) -> &'static str {
    match map {
        MAP_FRAME_COUNTERS => "the uplink ARP/NDP frame counters restart from zero",
        MAP_ARP_RESPONDER | MAP_NDP_RESPONDER => {
            "local pod addresses go unanswered until start-up recovery re-installs them from the attachment records"
        }
        MAP_RESPONDER_STATS => "the ARP/NDP answer counters restart from zero",
        MAP_MANAGED_ADDRS => {
            "foreign claims go unreported until start-up recovery re-installs the managed addresses"
        }
        MAP_CONFLICT_EVENTS => "conflict reports not yet read are lost",
        MAP_RECENT_CONFLICTS => "the record of recent address conflicts is forgotten",
        MAP_WIRE_CLAIMS => {
            "the wire inventory starts empty: addresses the LAN uses are known again when they are next claimed"
        }
        MAP_RESOLVE_WATCH => {
            "requesters of floating addresses go unrecorded until the floating-address loop lists its addresses again (its next heartbeat)"
        }
        MAP_NODE_MACS => {
            "frames between the node's own interfaces are taken for the LAN's until start-up recovery or the next pod lists the MACs again"
        }
        MAP_RESOLVERS => {
            "a takeover tells by unicast only the LAN hosts that resolve the address from then on (the broadcast announcements still go out)"
        }
        MAP_POLICY_CIDRS | MAP_POLICY_SUBJECTS => {
            "pods are not isolated by network policy until the policy controller applies it again"
        }
        MAP_POLICY_RULE_STATS => "the per-rule policy counters restart from zero",
        MAP_POLICY_STATS => "the policy verdict counters restart from zero",
        MAP_POLICY_CT => "tracked flows are judged again by policy",
        MAP_POLICY_FRAGS => "fragments of datagrams in flight are judged again by policy",
        MAP_POLICY_EVENTS => "policy drop reports not yet read are lost",
        MAP_POLICY_EVENT_BUDGET => "the drop-report rate limit starts afresh",
        _ => "its entries are lost",
    }
}

#[cfg(test)]
mod tests {
    use flatnet_common::pin::PINNED_MAPS;

    use super::*;

    const HOST: HostSizes = HostSizes {
        page_size: 4096,
        possible_cpus: 4,
    };

    fn lru_hash() -> MapLayout {
        MapLayout {
            map_type: bpf_map_type::BPF_MAP_TYPE_LRU_HASH as u32,
            key_size: 40,
            value_size: 16,
            max_entries: 65_536,
            flags: 0,
        }
    }

    #[test]
    fn identical_layouts_are_compatible() {
        assert_eq!(differences(&lru_hash(), &lru_hash()), []);
    }

    #[test]
    fn each_kind_of_difference_is_reported() {
        let expected = lru_hash();
        let cases = [
            (
                MapLayout {
                    map_type: bpf_map_type::BPF_MAP_TYPE_HASH as u32,
                    ..expected
                },
                LayoutField::MapType,
            ),
            (
                MapLayout {
                    key_size: 36,
                    ..expected
                },
                LayoutField::KeySize,
            ),
            (
                MapLayout {
                    value_size: 12,
                    ..expected
                },
                LayoutField::ValueSize,
            ),
            (
                MapLayout {
                    max_entries: 16_384,
                    ..expected
                },
                LayoutField::MaxEntries,
            ),
            (
                MapLayout {
                    flags: 2,
                    ..expected
                },
                LayoutField::Flags,
            ),
        ];
        for (pinned, field) in cases {
            assert_eq!(differences(&pinned, &expected), [field], "{pinned}");
        }
    }

    #[test]
    fn all_differences_are_reported_together() {
        let pinned = MapLayout {
            map_type: bpf_map_type::BPF_MAP_TYPE_ARRAY as u32,
            key_size: 4,
            value_size: 8,
            max_entries: 1,
            flags: 1,
        };
        assert_eq!(
            differences(&pinned, &lru_hash()),
            [
                LayoutField::MapType,
                LayoutField::KeySize,
                LayoutField::ValueSize,
                LayoutField::MaxEntries,
                LayoutField::Flags,
            ]
        );
    }

    #[test]
    fn probed_value_sizes_of_device_maps_are_not_compared() {
        let devmap = MapLayout {
            map_type: bpf_map_type::BPF_MAP_TYPE_DEVMAP as u32,
            key_size: 4,
            value_size: 4,
            max_entries: 8,
            flags: 0,
        };
        let pinned = MapLayout {
            value_size: 8,
            ..devmap
        };
        assert_eq!(differences(&pinned, &devmap), []);
        let pinned = MapLayout {
            max_entries: 16,
            ..pinned
        };
        assert_eq!(differences(&pinned, &devmap), [LayoutField::MaxEntries]);
    }

    #[test]
    fn ring_buffers_are_expected_as_aya_sizes_them() {
        let ring = aya_obj::Map::new_from_params(
            bpf_map_type::BPF_MAP_TYPE_RINGBUF as u32,
            0,
            24,
            5000,
            0,
        );
        let layout = MapLayout::as_created(&ring, HOST);
        assert_eq!(
            layout.value_size, 0,
            "the kernel's ring buffer has no value"
        );
        assert_eq!(layout.max_entries, 8192, "two pages");
        assert_eq!(ring_bytes(4096, 4096), 4096);
        assert_eq!(ring_bytes(3 * 4096, 4096), 4 * 4096);
        assert_eq!(ring_bytes(0, 4096), 0);
    }

    #[test]
    fn perf_arrays_without_size_get_one_entry_per_cpu() {
        let perf = |max_entries| {
            aya_obj::Map::new_from_params(
                bpf_map_type::BPF_MAP_TYPE_PERF_EVENT_ARRAY as u32,
                4,
                4,
                max_entries,
                0,
            )
        };
        assert_eq!(MapLayout::as_created(&perf(0), HOST).max_entries, 4);
        assert_eq!(MapLayout::as_created(&perf(2), HOST).max_entries, 2);
    }

    #[test]
    fn access_flags_are_not_expected_on_pins() {
        let map = aya_obj::Map::new_from_params(
            bpf_map_type::BPF_MAP_TYPE_ARRAY as u32,
            4,
            8,
            1,
            BPF_F_RDONLY | 1,
        );
        assert_eq!(MapLayout::as_created(&map, HOST).flags, 1);
    }

    #[test]
    fn the_embedded_object_defines_every_pinned_map() {
        let layouts = expected_layouts(super::super::EBPF_OBJECT, HOST).unwrap();
        for name in PINNED_MAPS {
            let layout = layouts.get(name).unwrap_or_else(|| panic!("{name}"));
            if layout.map_type == bpf_map_type::BPF_MAP_TYPE_RINGBUF as u32 {
                assert_eq!(layout.value_size, 0, "{name}");
                assert!(layout.max_entries.is_power_of_two(), "{name}: {layout}");
            } else {
                assert_ne!(layout.value_size, 0, "{name}: {layout}");
            }
        }
    }

    #[test]
    fn every_pinned_map_names_the_state_its_replacement_loses() {
        for name in PINNED_MAPS {
            assert_ne!(state_lost(name), state_lost("NOT_A_MAP"), "{name}");
        }
    }

    #[test]
    fn layouts_read_as_type_and_sizes() {
        assert_eq!(
            lru_hash().to_string(),
            "BPF_MAP_TYPE_LRU_HASH, key 40 B, value 16 B, 65536 entries, flags 0x0"
        );
    }
}
