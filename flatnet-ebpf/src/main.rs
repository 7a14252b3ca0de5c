//! flatnet's kernel programs.
//!
//! Entry points are thin: each calls a `try_*` function and turns its result
//! into an explicit TC verdict. Nothing here panics; a frame we cannot parse
//! is passed on untouched.
#![no_std]
#![no_main]

mod headers;
mod log;
mod mss_clamp;
mod policy;
mod uplink;

/// The verdict for a frame flatnet has no objection to (see
/// [`flatnet_common::verdict::PASS`]).
const TC_PASS: i32 = flatnet_common::verdict::PASS;

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    // Unreachable in a verified program: the verifier rejects code that could get here.
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";
