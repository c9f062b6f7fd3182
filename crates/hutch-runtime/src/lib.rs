//! Isolation for hutch: the `container` class (namespaces, an overlay root,
//! cgroups, seccomp, a uid range per sandbox) and the host side of the agent
//! link.
//!
//! Architecture invariant: this is the only crate of hutch with `unsafe`
//! besides hutch-agent (its system calls, and the `CLONE_VM` stack both
//! sides share); each block carries a SAFETY note, and the code that runs
//! between `clone` and `execveat` (launch.rs) makes only raw system calls
//! (`sys::raw`, no `errno`) on memory prepared before the clone.

pub mod agent;
pub mod agent_async;
pub mod capture;
pub mod cgroup;
pub mod container;
pub mod doctor;
pub mod gvisor;
pub mod image;
pub mod launch;
pub mod net;
pub mod portconnect;
pub mod process;
pub mod rootfs;
pub mod seccomp;
pub mod storage;
pub mod sys;
pub mod uids;

pub use container::{Config, RootSource, Runtime, RuntimeError, Sandbox, SandboxSpec, Writable};
pub use hutch_api::Class;
pub use process::ProcessSpec;
