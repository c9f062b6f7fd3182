//! The control plane of hutch: sandboxes and their lifetimes, commands and
//! their idempotency, file transfers, templates and builds, port access,
//! keys and quotas, and the reconciler.
//!
//! Architecture invariant: this crate knows no HTTP and no SQL. It takes
//! typed requests (hutch-api) and typed ids ([`ids`]), keeps state through
//! the `Store` trait (hutch-store) on the blocking pool, and drives
//! sandboxes through hutch-runtime. It is the only door to them: the HTTP
//! layer depends on this crate and hutch-api alone.

pub mod access;
pub mod audit;
mod batch;
pub mod build;
pub mod capabilities;
pub mod control;
pub mod dns;
pub mod e2b;
pub mod error;
pub mod events;
pub mod exec;
pub mod fileops;
pub mod files;
pub mod fleet;
pub mod grants;
pub mod history;
pub mod idle;
pub mod ids;
pub mod images;
pub mod keys;
pub mod lifecycle;
pub mod metrics;
pub mod moves;
pub mod network;
pub mod nodes;
pub mod pool;
pub mod process;
pub mod pty;
pub mod ready;
pub mod recover;
pub mod sandboxes;
pub mod secrets;
pub mod session;
pub mod snapshot_export;
pub mod snapshots;
pub mod templates;
pub mod timing;
pub mod usage;
pub mod volumes;
pub mod webhooks;

pub use control::{Capacity, Config, Control};
pub use error::ControlError;
pub use ids::{Caller, OwnerId, SandboxId, SnapshotId, TemplateId, VolumeId};
pub use sandboxes::{PAUSED_TTL_DEFAULT, PAUSED_TTL_MAX};
