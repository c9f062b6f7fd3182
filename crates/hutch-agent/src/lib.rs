//! The host-agent link of hutch: the wire protocol both sides speak, and
//! the one piece of system-call code both sides share.
//!
//! `proto` has no IO and no `unsafe`: it is the contract between the agent
//! (the binary in `main.rs`, PID 1 of a sandbox) and the host
//! (hutch-runtime). The host links it to encode requests and to decode,
//! bound and validate everything the agent sends back. `vm` is the stack
//! (with its guard page) and the clone of children that share their
//! parent's memory, which the agent uses to start commands and the host to
//! start sandboxes: one implementation, so both get the guard page.

pub mod proto;
pub mod vm;
