//! Kernel log records (aya-log), read by the agent as `tracing` events at
//! debug level under the target `flatnet_ebpf`.
//!
//! Only rare paths log: answers sent, conflicts reported and drops within
//! the drop-event budget, never a packet that simply passes. Each record is
//! built in a function of its own (never inlined): the records need stack
//! space the programs' own frames cannot spare. The uplink program's parser
//! alone nearly fills the 512-byte stack, so it only notes what happened in
//! a per-CPU slot and the record is built after the parser returned. When
//! the agent does not want kernel logs it sets the level to off at load
//! time and the verifier removes all of this.

use aya_ebpf::{btf_maps::PerCpuArray, macros::btf_map, programs::TcContext};
use aya_log_ebpf::{
    debug,
    macro_support::{Level, level_enabled},
};
use flatnet_common::policy::{Direction, DropReason, Flow};

/// What the uplink program did that is worth a record.
#[derive(Clone, Copy)]
#[repr(u32)]
pub enum Deferred {
    /// Nothing waiting.
    Nothing = 0,
    /// An ARP request was answered (`mac`: the answer's MAC, `other`: the requester).
    ArpAnswer = 1,
    /// A neighbour solicitation was answered (same fields).
    NdpAnswer = 2,
}

/// A record the uplink program wants written once its parser is done.
#[repr(C)]
pub struct DeferredRecord {
    kind: u32,
    ifindex: u32,
    addr: [u8; 16],
    mac: [u8; 6],
    other: [u8; 6],
}

/// One slot per CPU: a program run is never interrupted on its CPU by
/// another run of a TC program.
#[btf_map]
static UPLINK_LOG: PerCpuArray<DeferredRecord, 1> = PerCpuArray::new();

/// Whether records are wanted (fixed at load time; when off the verifier
/// removes every use).
#[inline(always)]
fn enabled() -> bool {
    level_enabled(Level::Debug)
}

/// Notes a record for [`flush_deferred`] (the uplink program's parser
/// frame leaves no room to build it in place).
#[inline(always)]
pub fn defer(kind: Deferred, addr: &[u8; 16], ifindex: u32, mac: &[u8; 6], other: &[u8; 6]) {
    if !enabled() {
        return;
    }
    if let Some(slot) = UPLINK_LOG.get_ptr_mut(0) {
        // SAFETY: per-CPU slot, so no other program instance writes it concurrently.
        unsafe {
            (*slot).kind = kind as u32;
            (*slot).ifindex = ifindex;
            (*slot).addr = *addr;
            (*slot).mac = *mac;
            (*slot).other = *other;
        }
    }
}

/// Writes the record [`defer`] noted during this run, if any.
#[inline(never)]
pub fn flush_deferred(ctx: &TcContext) {
    if !enabled() {
        return;
    }
    let Some(slot) = UPLINK_LOG.get_ptr_mut(0) else {
        return;
    };
    // SAFETY: per-CPU slot, so no other program instance writes it concurrently.
    let record = unsafe { &mut *slot };
    let kind = core::mem::replace(&mut record.kind, Deferred::Nothing as u32);
    if kind == Deferred::ArpAnswer as u32 {
        debug!(
            ctx,
            target: "flatnet_ebpf",
            "answered ARP request for {:i} from {:mac} on ifindex {} with {:mac}",
            record.addr,
            record.other,
            record.ifindex,
            record.mac
        );
    } else if kind == Deferred::NdpAnswer as u32 {
        debug!(
            ctx,
            target: "flatnet_ebpf",
            "answered neighbour solicitation for {:i} from {:mac} on ifindex {} with {:mac}",
            record.addr,
            record.other,
            record.ifindex,
            record.mac
        );
    }
}

/// A foreign MAC claimed a managed address; the conflict is being reported.
#[inline(never)]
pub fn conflict(
    ctx: &TcContext,
    addr: &[u8; 16],
    ifindex: u32,
    foreign: &[u8; 6],
    owner: &[u8; 6],
) {
    debug!(
        ctx,
        target: "flatnet_ebpf",
        "conflict: {:i} on ifindex {} claimed by {:mac}, owned by {:mac}",
        *addr,
        ifindex,
        *foreign,
        *owner
    );
}

/// A packet of `flow` was dropped at `direction` for `reason`.
#[inline(never)]
pub fn dropped(ctx: &TcContext, direction: Direction, flow: &Flow, reason: DropReason) {
    debug!(
        ctx,
        target: "flatnet_ebpf",
        "dropped {} {:i}:{} -> {:i}:{} protocol {}: {}",
        direction.name(),
        flow.src,
        flow.src_port,
        flow.dst,
        flow.dst_port,
        flow.protocol,
        reason.name()
    );
}
