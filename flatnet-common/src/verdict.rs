//! The TC verdicts flatnet's programs return, shared with the user-space
//! code that reads them back (`BPF_PROG_TEST_RUN`, benchmarks).
//!
//! The values are the kernel's `TC_ACT_*` codes, which TCX reads the same
//! way (`TCX_NEXT`, `TCX_DROP`, `TCX_REDIRECT`).

/// No objection (`TC_ACT_UNSPEC`): the frame goes on to the next program
/// (TCX) or filter (cls_bpf), and up the stack when there is none.
/// `TC_ACT_OK` would end the chain and skip other tools' programs after
/// ours; `TC_ACT_PIPE` ends a TCX chain too.
pub const PASS: i32 = -1;
/// Drop the frame (`TC_ACT_SHOT`).
pub const DROP: i32 = 2;
/// The frame was sent elsewhere by `bpf_redirect` (`TC_ACT_REDIRECT`).
pub const REDIRECT: i32 = 7;
