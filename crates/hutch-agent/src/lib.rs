//! The host-agent link of hutch: the wire protocol both sides speak.
//!
//! The library half of this crate has no IO and no `unsafe`: it is the
//! contract between the agent (the binary in `main.rs`, PID 1 of a sandbox)
//! and the host (hutch-runtime). The host links it to encode requests and to
//! decode, bound and validate everything the agent sends back.

pub mod proto;
