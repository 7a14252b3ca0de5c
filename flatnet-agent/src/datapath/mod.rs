//! Loading, attaching and pinning flatnet's eBPF programs.
//!
//! The kernel object is built by `cargo xtask build-ebpf` and embedded at
//! compile time (see `build.rs`). Maps are pinned under a root directory on
//! the BPF filesystem (default [`flatnet_common::pin::PIN_ROOT`]) and
//! adopted when they already exist and still have the layout the object
//! defines, so a restarted agent keeps the state of the previous one
//! (see `pin_layout` for pins left by another version). Programs are
//! attached through TCX links pinned under `<pin root>/links/` on Linux 6.6
//! and later, and through netlink (clsact) before; either way the
//! attachment stays in place when the agent exits (see `tc`).

mod bpffs;
mod conflicts;
mod counters;
mod kernel_log;
mod mss_clamp;
mod node_macs;
mod pin_layout;
mod pinned;
mod policy;
mod resolvers;
mod responder;
mod tc;
mod tc_netlink;
mod tcx;
mod test_run;
mod uplink;
mod wire;

use std::{
    os::fd::AsFd,
    path::{Path, PathBuf},
    time::Duration,
};

use aya::{Ebpf, EbpfLoader};
use flatnet_common::pin::{
    MAP_ARP_RESPONDER, MAP_CONFLICT_EVENTS, MAP_FRAME_COUNTERS, MAP_MANAGED_ADDRS,
    MAP_NDP_RESPONDER, MAP_NODE_MACS, MAP_RECENT_CONFLICTS, MAP_RESPONDER_STATS, MAP_WIRE_CLAIMS,
    PIN_ROOT, PINNED_MAPS, PROG_POLICY_EGRESS, PROG_POLICY_INGRESS, PROG_UPLINK_INGRESS,
};

pub use bpffs::{BPFFS_MOUNT_POINT, mount_bpffs, mount_bpffs_on_host};
pub use conflicts::{Conflict, ConflictMonitor, ManagedAddrs, RecentConflictEntry};
pub use counters::FrameCounters;
pub use kernel_log::{KERNEL_LOG_TARGET, KernelLogs, kernel_logs_wanted};
pub use mss_clamp::detach_mss_clamp;
pub use node_macs::{NodeMacs, interface_macs};
pub use pinned::PinnedMaps;
pub use policy::{
    ApplyReport, InstalledPolicy, PolicyDrop, PolicyDrops, PolicyMaps, PolicyRuleIds, PolicyStats,
    detach_policy,
};
pub use resolvers::{ResolveWatch, ResolverEntry};
pub use responder::{ResponderStats, Responders};
pub use tc::{AttachMechanism, TcAttach, kernel_has_tcx};
pub use test_run::TestRunOutput;
pub use uplink::detach_uplink;
pub use wire::{WireClaimEntry, WireClaims};

/// The eBPF object, embedded so the agent never runs against a stale build.
static EBPF_OBJECT: &[u8] = aya::include_bytes_aligned!(env!("FLATNET_EBPF_OBJECT"));

/// Errors of the data plane.
#[derive(Debug, thiserror::Error)]
pub enum DatapathError {
    /// The BPF filesystem is not usable at the pin root.
    #[error(
        "BPF filesystem not usable at {path}: {reason}; mount it with `mount -t bpf bpf /sys/fs/bpf`"
    )]
    Bpffs {
        /// The directory that should live on bpffs.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// Loading the object or creating its maps failed.
    #[error("loading the flatnet eBPF object failed (is the agent running as root?): {0}")]
    Load(#[from] aya::EbpfError),
    /// A program failed to load into or attach in the kernel.
    #[error("program {program} on {interface}: {source}")]
    Program {
        /// Program name.
        program: &'static str,
        /// Interface the program was being attached to or detached from.
        interface: String,
        /// The error from aya.
        #[source]
        source: aya::programs::ProgramError,
    },
    /// TCX was asked for on a kernel without it.
    #[error(
        "TCX attachment needs Linux 6.6 or later; use `--tc-attach netlink` (or `auto`) on this kernel"
    )]
    TcxUnsupported,
    /// A pinned TCX link could not be created, opened, read or removed.
    #[error("TCX link pinned at {path}: {source}")]
    PinLink {
        /// The pin (or its directory).
        path: PathBuf,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// A TC (qdisc/filter) operation failed.
    #[error("tc on {interface}: {source}; does the interface exist in this network namespace?")]
    Tc {
        /// Interface name.
        interface: String,
        /// The error from aya.
        #[source]
        source: aya::programs::tc::TcError,
    },
    /// An I/O error outside the BPF system calls (e.g. registering a ring buffer).
    #[error("I/O: {0}")]
    Io(#[source] std::io::Error),
    /// The conflict ring buffer was already handed out.
    #[error("the conflict monitor was already taken from this datapath")]
    MonitorTaken,
    /// `BPF_PROG_TEST_RUN` failed.
    #[error("BPF_PROG_TEST_RUN: {0}")]
    TestRun(#[source] std::io::Error),
    /// A map named in `flatnet-common` is absent from the object.
    #[error("map {0} missing from the eBPF object; rebuild with `cargo xtask build-ebpf`")]
    MissingMap(&'static str),
    /// The embedded object cannot be parsed for its map definitions.
    #[error(
        "the embedded eBPF object cannot be parsed: {0}; rebuild with `cargo xtask build-ebpf`"
    )]
    Object(#[source] aya_obj::ParseError),
    /// A map pinned by an earlier agent cannot be inspected, so it can be
    /// neither adopted nor replaced safely.
    #[error(
        "map {map} pinned at {path} cannot be inspected: {source}; remove it (`rm {path}`) and the agent creates a fresh, empty map in its place"
    )]
    InspectPin {
        /// Map name.
        map: &'static str,
        /// The pin.
        path: PathBuf,
        /// The error from aya (boxed: it is large and rare).
        #[source]
        source: Box<aya::maps::MapError>,
    },
    /// Looking up or removing a pin on the BPF filesystem failed.
    #[error("pin {path} of map {map}: {source}")]
    PinFile {
        /// Map name.
        map: &'static str,
        /// The pin.
        path: PathBuf,
        /// The error of the file operation.
        #[source]
        source: std::io::Error,
    },
    /// The compiled policy does not fit the kernel maps.
    #[error("network policy too large: {0}")]
    PolicyTooLarge(String),
    /// Reading or writing a map failed.
    #[error("map {map}: {source}")]
    Map {
        /// Map name.
        map: &'static str,
        /// The error from aya.
        #[source]
        source: aya::maps::MapError,
    },
}

/// Where pinned objects live and how programs are attached.
#[derive(Clone, Debug)]
pub struct DatapathConfig {
    /// Directory on bpffs holding the pinned maps and links. Created
    /// root-only (0700).
    pub pin_root: PathBuf,
    /// TCX, netlink, or whichever the kernel supports best.
    pub tc_attach: TcAttach,
}

impl DatapathConfig {
    /// Pins under `pin_root`, programs attached the best way the kernel has.
    pub fn pinned_at(pin_root: impl Into<PathBuf>) -> Self {
        Self {
            pin_root: pin_root.into(),
            tc_attach: TcAttach::Auto,
        }
    }
}

impl Default for DatapathConfig {
    fn default() -> Self {
        Self::pinned_at(PIN_ROOT)
    }
}

/// The loaded flatnet eBPF object with its maps pinned.
pub struct Datapath {
    ebpf: Ebpf,
    pin_root: PathBuf,
    mechanism: AttachMechanism,
    /// Whether the programs were loaded with kernel logging on.
    kernel_logs: bool,
}

impl Datapath {
    /// Loads the embedded object, adopting maps already pinned under
    /// `config.pin_root` and pinning the ones it creates. A pinned map
    /// whose type, key or value size, capacity or flags differ from the
    /// object's (left by an agent of another version) is replaced by an
    /// empty one, with a warning naming the state lost. The programs log
    /// when this process's subscriber wants debug events of
    /// [`KERNEL_LOG_TARGET`] (see [`kernel_logs_wanted`]).
    pub fn load(config: &DatapathConfig) -> Result<Self, DatapathError> {
        Self::load_with_kernel_logs(config, kernel_logs_wanted())
    }

    /// [`Datapath::load`] with kernel logging on or off as given.
    pub fn load_with_kernel_logs(
        config: &DatapathConfig,
        kernel_logs: bool,
    ) -> Result<Self, DatapathError> {
        let mechanism = config.tc_attach.resolve_here()?;
        bpffs::ensure_pin_root(&config.pin_root)?;
        let pins: Vec<_> = PINNED_MAPS
            .iter()
            .map(|&name| (name, map_pin_path(&config.pin_root, name)))
            .collect();
        pin_layout::remove_incompatible_pins(EBPF_OBJECT, &pins)?;
        let mut loader = EbpfLoader::new();
        kernel_log::set_level(&mut loader, kernel_logs);
        for (name, path) in &pins {
            loader.map_pin_path(name, path.as_path());
        }
        let ebpf = loader.load(EBPF_OBJECT)?;
        Ok(Self {
            ebpf,
            pin_root: config.pin_root.clone(),
            mechanism,
            kernel_logs,
        })
    }

    /// The classifiers an ADD attaches (the MSS clamping programs are
    /// attached by the primary-MTU pass, never in an ADD).
    pub const ADD_PROGRAMS: [&'static str; 3] =
        [PROG_UPLINK_INGRESS, PROG_POLICY_INGRESS, PROG_POLICY_EGRESS];

    /// Loads classifier `name` (one of [`Self::ADD_PROGRAMS`]) now, so that the
    /// kernel verifies it before its first attach rather than during it:
    /// verifying takes up to hundreds of milliseconds, which the first
    /// pod's ADD would wait for. Answers how long it took (nothing when it
    /// was loaded already).
    ///
    /// # Errors
    /// The program did not load (its first attach fails the same way).
    pub fn verify_program(&mut self, name: &'static str) -> Result<Duration, DatapathError> {
        let started = std::time::Instant::now();
        tc::loaded_classifier(&mut self.ebpf, name).map(|_| started.elapsed())
    }

    /// The pin root this datapath uses.
    pub fn pin_root(&self) -> &Path {
        &self.pin_root
    }

    /// How this datapath attaches programs.
    pub fn attach_mechanism(&self) -> AttachMechanism {
        self.mechanism
    }

    /// Attaches the uplink ingress program to `interface` in the calling
    /// thread's network namespace, replacing an earlier flatnet attachment.
    /// The attachment outlives this process.
    pub fn attach_uplink(&mut self, interface: &str) -> Result<(), DatapathError> {
        uplink::attach(&mut self.ebpf, &self.pin_root, self.mechanism, interface)
    }

    /// Attaches the policy programs (ingress and egress) to the pod
    /// interface `interface` in the calling thread's network namespace,
    /// replacing earlier flatnet policy attachments. Policy updates only
    /// change maps ([`PolicyMaps`]); the attachment stays.
    pub fn attach_policy(&mut self, interface: &str) -> Result<(), DatapathError> {
        policy::attach(&mut self.ebpf, &self.pin_root, self.mechanism, interface)
    }

    /// [`Self::attach_policy`] through netlink (clsact filters) whatever
    /// the mechanism: a new TCX link waits for an RCU grace period while
    /// holding RTNL (about 13 ms per program), a filter does not. Returns
    /// whether [`Self::attach_policy`] should follow later to move the
    /// programs into TCX links (it replaces the filters only once the links
    /// are in place).
    pub fn attach_policy_at_once(&mut self, interface: &str) -> Result<bool, DatapathError> {
        policy::attach(
            &mut self.ebpf,
            &self.pin_root,
            AttachMechanism::Netlink,
            interface,
        )?;
        Ok(self.mechanism != AttachMechanism::Netlink)
    }

    /// Attaches the TCP MSS clamping programs (ingress and egress) to
    /// `interface`, a pod's primary interface, in the calling thread's
    /// network namespace, replacing earlier flatnet clamping attachments.
    /// They read the interface's MTU at each packet, so an MTU change needs
    /// nothing here. The attachments outlive the process; see
    /// [`detach_mss_clamp`].
    pub fn attach_mss_clamp(&mut self, interface: &str) -> Result<(), DatapathError> {
        tc::attach_or_replace(
            &mut self.ebpf,
            &self.pin_root,
            self.mechanism,
            interface,
            &mss_clamp::SLOTS,
        )
    }

    /// Runs the MSS clamping program of `direction` once on `frame` with
    /// `BPF_PROG_TEST_RUN`, as if on the interface `ifindex` of the calling
    /// thread's network namespace (whose MTU it clamps to).
    pub fn test_run_mss_clamp(
        &mut self,
        direction: flatnet_common::policy::Direction,
        frame: &[u8],
        ifindex: u32,
    ) -> Result<TestRunOutput, DatapathError> {
        let slot = match direction {
            flatnet_common::policy::Direction::Ingress => mss_clamp::SLOTS[0],
            flatnet_common::policy::Direction::Egress => mss_clamp::SLOTS[1],
        };
        let program = tc::loaded_classifier(&mut self.ebpf, slot.program)?;
        let fd = program.fd().map_err(|source| DatapathError::Program {
            program: slot.program,
            interface: "(test run)".into(),
            source,
        })?;
        test_run::run(fd.as_fd(), frame, 1, ifindex).map_err(DatapathError::TestRun)
    }

    /// Removes the pins of TCX links whose interface is gone (a deleted
    /// pod's interface takes its programs with it, but their pins stay).
    /// Returns the pins removed.
    pub fn remove_defunct_links(&self) -> Result<Vec<PathBuf>, DatapathError> {
        tcx::remove_defunct(&self.pin_root, None)
    }

    /// [`Self::remove_defunct_links`] for the links in the network
    /// namespace at `netns` only: what one pod's DEL leaves, without
    /// looking at every other pod's pins.
    pub fn remove_defunct_links_in(&self, netns: &Path) -> Result<Vec<PathBuf>, DatapathError> {
        use std::os::unix::fs::MetadataExt;
        let inode = std::fs::metadata(crate::netns::as_seen_here(netns))
            .map_err(|source| DatapathError::PinLink {
                path: netns.to_path_buf(),
                source,
            })?
            .ino();
        tcx::remove_defunct(&self.pin_root, Some(inode))
    }

    /// The table maps of this datapath, opened again through their pins
    /// (usable apart from the programs).
    pub fn pinned_maps(&self) -> Result<PinnedMaps, DatapathError> {
        PinnedMaps::open(&self.pin_root)
    }

    /// The policy maps of this datapath (opened through their pins).
    pub fn policy_maps(&self) -> Result<PolicyMaps, DatapathError> {
        PolicyMaps::open(&self.pin_root)
    }

    /// Runs the policy program of `direction` once per `repeat` on `frame`
    /// with `BPF_PROG_TEST_RUN`.
    pub fn test_run_policy(
        &mut self,
        direction: flatnet_common::policy::Direction,
        frame: &[u8],
        repeat: u32,
    ) -> Result<TestRunOutput, DatapathError> {
        let name = policy::program_name(direction);
        let program = tc::loaded_classifier(&mut self.ebpf, name)?;
        let fd = program.fd().map_err(|source| DatapathError::Program {
            program: name,
            interface: "(test run)".into(),
            source,
        })?;
        test_run::run(fd.as_fd(), frame, repeat, 0).map_err(DatapathError::TestRun)
    }

    /// The ARP/NDP responder tables.
    pub fn responders(&mut self) -> Result<Responders<'_>, DatapathError> {
        let mut arp = None;
        let mut ndp = None;
        for (name, map) in self.ebpf.maps_mut() {
            match name {
                MAP_ARP_RESPONDER => arp = Some(map),
                MAP_NDP_RESPONDER => ndp = Some(map),
                _ => {}
            }
        }
        Responders::new(
            arp.ok_or(DatapathError::MissingMap(MAP_ARP_RESPONDER))?,
            ndp.ok_or(DatapathError::MissingMap(MAP_NDP_RESPONDER))?,
        )
    }

    /// Runs the uplink program once per `repeat` on `frame` with
    /// `BPF_PROG_TEST_RUN`, as if it arrived on the loopback interface
    /// (ifindex 1) of the calling thread's network namespace.
    pub fn test_run_uplink(
        &mut self,
        frame: &[u8],
        repeat: u32,
    ) -> Result<TestRunOutput, DatapathError> {
        let program = uplink::loaded_program(&mut self.ebpf)?;
        let fd = program.fd().map_err(|source| DatapathError::Program {
            program: flatnet_common::pin::PROG_UPLINK_INGRESS,
            interface: "(test run)".into(),
            source,
        })?;
        test_run::run(fd.as_fd(), frame, repeat, 0).map_err(DatapathError::TestRun)
    }

    /// The addresses whose foreign claims are reported.
    pub fn managed_addrs(&mut self) -> Result<ManagedAddrs<'_>, DatapathError> {
        let map = self
            .ebpf
            .map_mut(MAP_MANAGED_ADDRS)
            .ok_or(DatapathError::MissingMap(MAP_MANAGED_ADDRS))?;
        ManagedAddrs::new(map)
    }

    /// The node's own MACs.
    pub fn node_macs(&mut self) -> Result<NodeMacs<'_>, DatapathError> {
        let map = self
            .ebpf
            .map_mut(MAP_NODE_MACS)
            .ok_or(DatapathError::MissingMap(MAP_NODE_MACS))?;
        NodeMacs::new(map)
    }

    /// The stream of conflicts; can be taken once per loaded datapath.
    /// Must be called inside a tokio runtime.
    pub fn conflict_monitor(&mut self) -> Result<ConflictMonitor, DatapathError> {
        let map = self
            .ebpf
            .take_map(MAP_CONFLICT_EVENTS)
            .ok_or(DatapathError::MonitorTaken)?;
        ConflictMonitor::new(map)
    }

    /// The reader of the programs' log records, when they were loaded with
    /// logging on (the subscriber wants debug events of
    /// [`KERNEL_LOG_TARGET`]); `None` otherwise. Can be taken once; must
    /// be called inside a tokio runtime.
    pub fn kernel_logs(&mut self) -> Result<Option<KernelLogs>, DatapathError> {
        if !std::mem::take(&mut self.kernel_logs) {
            return Ok(None);
        }
        KernelLogs::new(&mut self.ebpf).map(Some)
    }

    /// The latest conflict on each managed address, latest first.
    pub fn recent_conflicts(&self) -> Result<Vec<RecentConflictEntry>, DatapathError> {
        conflicts::recent_conflicts(self.map(MAP_RECENT_CONFLICTS)?)
    }

    /// The wire inventory: the MAC last seen claiming each address.
    pub fn wire_claims(&self) -> Result<Vec<WireClaimEntry>, DatapathError> {
        wire::wire_claims(self.map(MAP_WIRE_CLAIMS)?)
    }

    /// Answers the uplink program has sent, summed over CPUs.
    pub fn responder_stats(&self) -> Result<ResponderStats, DatapathError> {
        ResponderStats::read(self.map(MAP_RESPONDER_STATS)?)
    }

    /// Current uplink frame counters, summed over CPUs.
    pub fn frame_counters(&self) -> Result<FrameCounters, DatapathError> {
        FrameCounters::read(self.map(MAP_FRAME_COUNTERS)?)
    }

    fn map(&self, name: &'static str) -> Result<&aya::maps::Map, DatapathError> {
        self.ebpf.map(name).ok_or(DatapathError::MissingMap(name))
    }
}

/// `CLOCK_MONOTONIC`, the clock of `bpf_ktime_get_ns`, in nanoseconds:
/// the time base of the maps' timestamps and of responder leases.
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid timespec the call writes.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &raw mut ts) };
    // The monotonic clock is never negative.
    ts.tv_sec.cast_unsigned() * 1_000_000_000 + ts.tv_nsec.cast_unsigned()
}

/// `aa:bb:cc:dd:ee:ff`.
pub fn format_mac(mac: [u8; 6]) -> String {
    mac.map(|b| format!("{b:02x}")).join(":")
}

/// Whether a map operation failed because the key is absent. aya reports
/// a delete of a missing key as the syscall's `ENOENT`, not as
/// `KeyNotFound`.
fn is_missing_key(error: &aya::maps::MapError) -> bool {
    match error {
        aya::maps::MapError::KeyNotFound => true,
        aya::maps::MapError::SyscallError(e) => e.io_error.raw_os_error() == Some(libc::ENOENT),
        _ => false,
    }
}

fn map_error(map: &'static str) -> impl Fn(aya::maps::MapError) -> DatapathError {
    move |source| DatapathError::Map { map, source }
}

/// Path of a pinned map under `pin_root`.
pub fn map_pin_path(pin_root: &Path, map: &str) -> PathBuf {
    pin_root.join(map)
}
