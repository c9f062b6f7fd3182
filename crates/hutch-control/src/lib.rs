//! The control plane of hutch: sandboxes and their lifetimes, commands and
//! their idempotency, file transfers, and the reconciler.
//!
//! Architecture invariant: this crate knows no HTTP and no SQL. It takes
//! typed requests (hutch-api), keeps state through the `Store` trait
//! (hutch-store), and drives sandboxes through hutch-runtime.

pub mod access;
pub mod build;
pub mod control;
pub mod dns;
pub mod error;
pub mod exec;
pub mod files;
pub mod keys;
pub mod metrics;
pub mod network;
pub mod pool;
pub mod ready;
pub mod session;
pub mod templates;

pub use control::Control;
pub use error::ControlError;
