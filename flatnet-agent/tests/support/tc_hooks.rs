//! What runs on an interface's TC hooks, whichever way it was attached.

use aya::programs::{SchedClassifier, TcAttachType};
use flatnet_agent::{
    datapath::{AttachMechanism, kernel_has_tcx},
    netns::run_in_netns,
};

use std::path::Path;

use flatnet_common::pin::LINKS_DIR;

use super::TestNetns;

/// One program on a hook.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Attached {
    pub mechanism: AttachMechanism,
    pub name: String,
    /// The kernel's program id: a replaced program has a new one.
    pub id: u32,
}

/// The programs on `dev`'s `hook` in `ns`: TCX links in the order they
/// run, then netlink (cls_bpf) filters.
pub fn attached_programs(ns: &TestNetns, dev: &str, hook: TcAttachType) -> Vec<Attached> {
    let mut programs = Vec::new();
    if kernel_has_tcx() {
        let (_, infos) = run_in_netns(&ns.path(), || SchedClassifier::query_tcx(dev, hook))
            .expect("enter netns")
            .expect("query the TCX programs");
        programs.extend(infos.iter().map(|info| Attached {
            mechanism: AttachMechanism::Tcx,
            name: info.name_as_str().expect("program name").to_owned(),
            id: info.id(),
        }));
    }
    let hook_name = match hook {
        TcAttachType::Ingress => "ingress",
        TcAttachType::Egress => "egress",
        TcAttachType::Custom(_) => panic!("flatnet attaches to ingress and egress only"),
    };
    // `... bpf chain 0 handle 0x1 <section> direct-action ... id 42 name <program> tag ...`
    let filters = ns.exec("tc", &["filter", "show", "dev", dev, hook_name]);
    programs.extend(filters.lines().filter_map(|line| {
        let after = |key: &str| {
            let mut words = line.split_whitespace().skip_while(|word| *word != key);
            words.nth(1)
        };
        Some(Attached {
            mechanism: AttachMechanism::Netlink,
            name: after("name")?.to_owned(),
            id: after("id")?.parse().expect("program id"),
        })
    }));
    programs
}

/// The names of the TCX link pins under `pin_root` (none when the
/// directory does not exist: nothing was attached through TCX).
pub fn link_pins(pin_root: &Path) -> Vec<String> {
    match std::fs::read_dir(pin_root.join(LINKS_DIR)) {
        Ok(entries) => entries
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
        Err(e) => panic!("read the link pins: {e}"),
    }
}

/// The names of the programs on both TC hooks of the pod's `eth0`.
pub fn primary_programs(pod: &TestNetns) -> Vec<String> {
    [TcAttachType::Ingress, TcAttachType::Egress]
        .into_iter()
        .flat_map(|hook| attached_programs(pod, "eth0", hook))
        .map(|program| program.name)
        .collect()
}

/// The TCP MSS clamping programs, as [`primary_programs`] lists them.
pub const CLAMP_PROGRAMS: [&str; 2] = ["mss_clamp_in", "mss_clamp_out"];
