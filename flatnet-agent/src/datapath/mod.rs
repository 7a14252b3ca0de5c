//! Loading, attaching and pinning the eBPF programs.
