//! `BPF_PROG_TEST_RUN` for TC programs: run a program on a crafted frame in
//! the kernel without any interface, and get its verdict and output frame.

use std::{
    io,
    os::fd::{AsRawFd, BorrowedFd},
};

/// `BPF_PROG_TEST_RUN` command number (include/uapi/linux/bpf.h).
const BPF_PROG_TEST_RUN: libc::c_long = 10;

/// Headroom for frames the program grows (neighbour advertisements).
const OUTPUT_SLACK: usize = 256;

/// The `test` member of `union bpf_attr`, followed by zeroed space so the
/// kernel sees every later field as unset.
#[repr(C, align(8))]
#[derive(Default)]
struct TestRunAttr {
    prog_fd: u32,
    retval: u32,
    data_size_in: u32,
    data_size_out: u32,
    data_in: u64,
    data_out: u64,
    repeat: u32,
    duration: u32,
    ctx_size_in: u32,
    ctx_size_out: u32,
    ctx_in: u64,
    ctx_out: u64,
    flags: u32,
    cpu: u32,
    batch_size: u32,
    _reserved: u32,
}

/// What one test run returned.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TestRunOutput {
    /// The program's return value, a TC verdict (see
    /// [`flatnet_common::verdict`]).
    pub verdict: i32,
    /// The frame after the program ran.
    pub frame: Vec<u8>,
    /// Average run time per repetition, as measured by the kernel.
    pub duration_ns: u32,
}

/// The start of `struct __sk_buff` through `ifindex`, the one field the
/// test runs set (the kernel requires the fields before it to be zero).
#[repr(C)]
#[derive(Default)]
struct SkbContext {
    fields_before_ifindex: [u32; 10],
    ifindex: u32,
}

/// Runs the program `repeat` times (at least once) on `frame`, as if it
/// arrived on (or left through) the interface `ifindex` of the calling
/// thread's network namespace; 0: the loopback interface.
pub(super) fn run(
    program: BorrowedFd<'_>,
    frame: &[u8],
    repeat: u32,
    ifindex: u32,
) -> io::Result<TestRunOutput> {
    let mut out = vec![0u8; frame.len() + OUTPUT_SLACK];
    let context = SkbContext {
        ifindex,
        ..SkbContext::default()
    };
    let mut attr = TestRunAttr {
        prog_fd: program.as_raw_fd().cast_unsigned(),
        data_size_in: frame.len() as u32,
        data_size_out: out.len() as u32,
        data_in: frame.as_ptr() as u64,
        data_out: out.as_mut_ptr() as u64,
        repeat: repeat.max(1),
        ctx_size_in: if ifindex == 0 {
            0
        } else {
            std::mem::size_of::<SkbContext>() as u32
        },
        ctx_in: if ifindex == 0 {
            0
        } else {
            (&raw const context) as u64
        },
        ..TestRunAttr::default()
    };
    // SAFETY: `attr` points at valid input and output buffers (and
    // context) of the sizes given, and they outlive the call.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            BPF_PROG_TEST_RUN,
            &raw mut attr,
            std::mem::size_of::<TestRunAttr>() as libc::c_uint,
        )
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    out.truncate(attr.data_size_out as usize);
    Ok(TestRunOutput {
        // The kernel returns the program's int as u32.
        verdict: attr.retval.cast_signed(),
        frame: out,
        duration_ns: attr.duration,
    })
}
