//! Wire types of hutch's native HTTP API and its stable error codes.
//!
//! Serde and OpenAPI schemas only: no IO. The server renders these, the CLI
//! and clients parse them, and the OpenAPI document is generated from them.

pub mod time;

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use utoipa::ToSchema;

/// Most bytes of each output stream kept in a command's JSON result.
pub const OUTPUT_CAP: usize = 1 << 20;
/// Most bytes in one base64 file read or write.
pub const FILE_DATA_CAP: usize = 8 << 20;
/// Most commands holding slots in one sandbox.
pub const COMMAND_SLOTS: usize = 64;

/// Every error the API answers with: `{"error": "...", "code": "..."}`.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq, Eq)]
pub struct ErrorBody {
    /// Human-readable; may change. Use `code`.
    pub error: String,
    pub code: ErrorCode,
}

/// Stable error codes. Clients must accept codes they do not know.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, ToSchema, PartialEq, Eq, Hash)]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    /// Missing, malformed or revoked API key.
    Unauthorized,
    /// The request body, query or a header is malformed or out of range.
    InvalidRequest,
    /// No such route, sandbox, process or file.
    NotFound,
    /// The template named does not exist.
    UnknownTemplate,
    /// The caller already has a template of this name.
    TemplateNameTaken,
    /// The image named is neither `base`, a preset, nor in the image store.
    ImageNotFound,
    /// The same Idempotency-Key was used with a different request.
    IdempotencyConflict,
    /// A command with this Idempotency-Key is running, or its outcome was
    /// lost; it will not be run again.
    ExecutionOutcomeUnknown,
    /// The sandbox is not running (starting, suspended, terminating or
    /// terminated); the command was not sent.
    SandboxSessionNotRunning,
    /// The sandbox lives on another node of the fleet (the message names
    /// it); this node does not act on it. Ask that node.
    SandboxOnOtherNode,
    /// The sandbox's node did not answer the request this node forwarded
    /// to it (it is down or unreachable); nothing was done.
    NodeUnreachable,
    /// All command slots of the sandbox are in use; nothing was started.
    SandboxCommandCapacity,
    /// The host cannot start another sandbox now.
    SandboxCapacityUnavailable,
    /// The sandbox failed to start; the command did not run.
    SandboxStartFailed,
    /// The sandbox's writable layer is full.
    SandboxDiskFull,
    /// A path is malformed (empty, `..`, NUL, too long).
    InvalidPath,
    /// A file or directory is in the way, or the user cannot write there.
    SandboxPathConflict,
    /// The path is not a directory (or passes through a symlink).
    SandboxPathNotDirectory,
    /// The sandbox user cannot read the path.
    SandboxPathUnreadable,
    /// An archive is malformed or holds an entry that is not allowed.
    SandboxArchiveInvalid,
    /// An archive exceeds a per-request limit.
    SandboxArchiveTooLarge,
    /// A file part starts past the bytes received.
    SandboxFilePartOutOfOrder,
    /// The finished file does not match its size or digest.
    SandboxFilePartMismatch,
    /// A request body exceeds its limit.
    PayloadTooLarge,
    /// The host cannot provide what was asked (e.g. networking is not set up).
    FeatureUnavailable,
    /// The sandbox's network policy (`deny_all`) forbids this.
    SandboxNetworkIsolated,
    /// The template's startup command exited before the sandbox was ready.
    SandboxStartupFailed,
    /// The template's readiness check did not pass within its timeout.
    SandboxReadinessTimeout,
    /// A build's Dockerfile holds an instruction hutch does not run (FROM,
    /// ENTRYPOINT, USER, ADD, ...) or one that is malformed; nothing was built.
    BuildInstructionRefused,
    /// The service is shutting down or a dependency is unavailable.
    Unavailable,
    /// An internal error; details are in the server's log, never here.
    Internal,
    /// The port proxy got no access token (header or cookie).
    AccessTokenRequired,
    /// The access token is unknown, malformed or revoked.
    AccessTokenInvalid,
    /// The access token expired.
    AccessTokenExpired,
    /// The access token is for another sandbox or port.
    AccessTokenWrongTarget,
    /// A sandbox has as many live access grants as it may have.
    AccessGrantCapacity,
    /// Nothing accepts connections on the port inside the sandbox.
    SandboxPortUnreachable,
    /// The caller's key may not do this (an admin-only operation, or
    /// another owner's thing it may see but not use).
    Forbidden,
    /// The request would take the caller's key past one of its quotas
    /// (sandboxes, memory, disk, lifetime, builds); nothing was made.
    QuotaExceeded,
    /// The route exists, but not with this method.
    MethodNotAllowed,
    /// The caller already has a snapshot of this name.
    SnapshotNameTaken,
    /// The sandbox's files are in memory (`"storage": "memory"`): only a
    /// disk layer can be snapshotted.
    SnapshotUnsupported,
    /// The sandbox's isolation class cannot do this (a `process` sandbox:
    /// root, its own network policy, volumes, ports, disk layers).
    ClassUnsupported,
    /// The host's storage for sandboxes' files is full.
    StorageFull,
    /// The snapshot cannot become an image archive: its sandbox ran on
    /// `base` (the host's files), its image left the store, or it holds
    /// what an image layer cannot carry.
    SnapshotNotExportable,
    /// A sandbox paused to disk, or a snapshot, whose files cannot start
    /// on another node (not pushed to the fleet's registry: it ran on
    /// `base`, or no registry is set; the message says which).
    NotMovable,
    /// The thing changed while the request was made; read it again and retry.
    Conflict,
    /// No volume of this name or id is the caller's.
    VolumeNotFound,
    /// The caller already has a volume of this name.
    VolumeNameTaken,
    /// The volume is mounted by a sandbox that has not ended (read-write by
    /// one, or read-only by others when read-write is asked); or, for a
    /// delete, by any.
    VolumeInUse,
    /// A mount path outside `/workspace`, `/home/user`, `/mnt` and `/data`,
    /// not absolute, with `..`, or given twice.
    VolumePathInvalid,
    /// A volume's size cannot go down.
    VolumeShrinkRefused,
    /// An image archive, manifest or name is malformed (not a `docker
    /// save` or OCI layout, a digest that does not match, a bad name);
    /// nothing was recorded.
    ImageInvalid,
    /// A layer of an image holds what hutch does not unpack (a path out of
    /// the layer, a write through a symlink, past a size limit); nothing
    /// was recorded.
    ImageLayerRefused,
    /// The registry of a pull refused or failed (unknown reference,
    /// authentication, TLS, a digest that does not match); nothing was
    /// recorded.
    RegistryError,
    /// An image build on the host (mmdebstrap from the host's Debian
    /// mirror) failed; the message carries the builder's last lines.
    /// Nothing was recorded.
    ImageBuildFailed,
    /// A webhook's URL is not `https://` (nor `http://` to an address the
    /// operator allows), names an address webhooks never reach (the host's
    /// own, loopback, link-local and cloud metadata, sandbox networks), or
    /// does not resolve; nothing was made.
    WebhookUrlRefused,
    /// The key has as many webhooks as it may have; delete one first.
    WebhookLimitReached,
    /// The credential is a grant, and the grant does not cover this call
    /// (another sandbox, an operation it does not name, or anything but
    /// the sandbox routes).
    GrantScope,
    /// The grant expired.
    GrantExpired,
    /// A usage report's window is malformed: `from` or `to` neither RFC
    /// 3339 nor Unix seconds, `to` not after `from`, or longer than 400
    /// days.
    UsageRangeInvalid,
    /// No secret of this name is the caller's.
    SecretNotFound,
    /// The caller already has a secret of this name.
    SecretNameTaken,
    /// No node of the fleet has this name.
    NodeNotFound,
    /// The node asked is draining (or was declared lost): it takes no new
    /// sandboxes. Send the create to another node.
    NodeDraining,
}

impl ErrorCode {
    /// The HTTP status of each code; one place, no wildcard.
    pub fn status(self) -> u16 {
        match self {
            ErrorCode::Unauthorized
            | ErrorCode::AccessTokenRequired
            | ErrorCode::AccessTokenInvalid
            | ErrorCode::AccessTokenExpired
            | ErrorCode::GrantExpired => 401,
            ErrorCode::AccessTokenWrongTarget | ErrorCode::Forbidden | ErrorCode::GrantScope => 403,
            ErrorCode::InvalidRequest
            | ErrorCode::UnknownTemplate
            | ErrorCode::ImageNotFound
            | ErrorCode::InvalidPath
            | ErrorCode::SandboxPathNotDirectory
            | ErrorCode::SandboxPathUnreadable
            | ErrorCode::SandboxArchiveInvalid
            | ErrorCode::FeatureUnavailable
            | ErrorCode::SandboxNetworkIsolated
            | ErrorCode::BuildInstructionRefused
            | ErrorCode::VolumePathInvalid
            | ErrorCode::VolumeShrinkRefused
            | ErrorCode::ImageInvalid
            | ErrorCode::ImageLayerRefused
            | ErrorCode::WebhookUrlRefused
            | ErrorCode::UsageRangeInvalid => 400,
            ErrorCode::NotFound | ErrorCode::VolumeNotFound | ErrorCode::SecretNotFound | ErrorCode::NodeNotFound => {
                404
            }
            ErrorCode::MethodNotAllowed => 405,
            ErrorCode::IdempotencyConflict
            | ErrorCode::ExecutionOutcomeUnknown
            | ErrorCode::SandboxSessionNotRunning
            | ErrorCode::SandboxOnOtherNode
            | ErrorCode::SandboxDiskFull
            | ErrorCode::SandboxPathConflict
            | ErrorCode::SandboxFilePartOutOfOrder
            | ErrorCode::SandboxFilePartMismatch
            | ErrorCode::TemplateNameTaken
            | ErrorCode::SnapshotNameTaken
            | ErrorCode::SnapshotUnsupported
            | ErrorCode::ClassUnsupported
            | ErrorCode::SnapshotNotExportable
            | ErrorCode::NotMovable
            | ErrorCode::VolumeNameTaken
            | ErrorCode::VolumeInUse
            | ErrorCode::SecretNameTaken
            | ErrorCode::Conflict => 409,
            ErrorCode::SandboxArchiveTooLarge | ErrorCode::PayloadTooLarge => 413,
            ErrorCode::SandboxCommandCapacity
            | ErrorCode::SandboxCapacityUnavailable
            | ErrorCode::AccessGrantCapacity
            | ErrorCode::QuotaExceeded
            | ErrorCode::WebhookLimitReached => 429,
            ErrorCode::Internal => 500,
            ErrorCode::SandboxPortUnreachable
            | ErrorCode::RegistryError
            | ErrorCode::ImageBuildFailed
            | ErrorCode::NodeUnreachable => 502,
            ErrorCode::SandboxStartFailed
            | ErrorCode::SandboxStartupFailed
            | ErrorCode::SandboxReadinessTimeout
            | ErrorCode::NodeDraining
            | ErrorCode::Unavailable => 503,
            ErrorCode::StorageFull => 507,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            ErrorCode::Unauthorized => "unauthorized",
            ErrorCode::InvalidRequest => "invalid_request",
            ErrorCode::NotFound => "not_found",
            ErrorCode::UnknownTemplate => "unknown_template",
            ErrorCode::TemplateNameTaken => "template_name_taken",
            ErrorCode::ImageNotFound => "image_not_found",
            ErrorCode::IdempotencyConflict => "idempotency_conflict",
            ErrorCode::ExecutionOutcomeUnknown => "execution_outcome_unknown",
            ErrorCode::SandboxSessionNotRunning => "sandbox_session_not_running",
            ErrorCode::SandboxOnOtherNode => "sandbox_on_other_node",
            ErrorCode::NodeUnreachable => "node_unreachable",
            ErrorCode::SandboxCommandCapacity => "sandbox_command_capacity",
            ErrorCode::SandboxCapacityUnavailable => "sandbox_capacity_unavailable",
            ErrorCode::SandboxStartFailed => "sandbox_start_failed",
            ErrorCode::SandboxDiskFull => "sandbox_disk_full",
            ErrorCode::InvalidPath => "invalid_path",
            ErrorCode::SandboxPathConflict => "sandbox_path_conflict",
            ErrorCode::SandboxPathNotDirectory => "sandbox_path_not_directory",
            ErrorCode::SandboxPathUnreadable => "sandbox_path_unreadable",
            ErrorCode::SandboxArchiveInvalid => "sandbox_archive_invalid",
            ErrorCode::SandboxArchiveTooLarge => "sandbox_archive_too_large",
            ErrorCode::SandboxFilePartOutOfOrder => "sandbox_file_part_out_of_order",
            ErrorCode::SandboxFilePartMismatch => "sandbox_file_part_mismatch",
            ErrorCode::PayloadTooLarge => "payload_too_large",
            ErrorCode::FeatureUnavailable => "feature_unavailable",
            ErrorCode::SandboxNetworkIsolated => "sandbox_network_isolated",
            ErrorCode::SandboxStartupFailed => "sandbox_startup_failed",
            ErrorCode::SandboxReadinessTimeout => "sandbox_readiness_timeout",
            ErrorCode::BuildInstructionRefused => "build_instruction_refused",
            ErrorCode::Unavailable => "unavailable",
            ErrorCode::Internal => "internal",
            ErrorCode::AccessTokenRequired => "access_token_required",
            ErrorCode::AccessTokenInvalid => "access_token_invalid",
            ErrorCode::AccessTokenExpired => "access_token_expired",
            ErrorCode::AccessTokenWrongTarget => "access_token_wrong_target",
            ErrorCode::AccessGrantCapacity => "access_grant_capacity",
            ErrorCode::SandboxPortUnreachable => "sandbox_port_unreachable",
            ErrorCode::Forbidden => "forbidden",
            ErrorCode::QuotaExceeded => "quota_exceeded",
            ErrorCode::MethodNotAllowed => "method_not_allowed",
            ErrorCode::Conflict => "conflict",
            ErrorCode::SnapshotNameTaken => "snapshot_name_taken",
            ErrorCode::SnapshotUnsupported => "snapshot_unsupported",
            ErrorCode::ClassUnsupported => "class_unsupported",
            ErrorCode::StorageFull => "storage_full",
            ErrorCode::SnapshotNotExportable => "snapshot_not_exportable",
            ErrorCode::NotMovable => "not_movable",
            ErrorCode::VolumeNotFound => "volume_not_found",
            ErrorCode::VolumeNameTaken => "volume_name_taken",
            ErrorCode::VolumeInUse => "volume_in_use",
            ErrorCode::VolumePathInvalid => "volume_path_invalid",
            ErrorCode::VolumeShrinkRefused => "volume_shrink_refused",
            ErrorCode::ImageInvalid => "image_invalid",
            ErrorCode::ImageLayerRefused => "image_layer_refused",
            ErrorCode::RegistryError => "registry_error",
            ErrorCode::ImageBuildFailed => "image_build_failed",
            ErrorCode::WebhookUrlRefused => "webhook_url_refused",
            ErrorCode::WebhookLimitReached => "webhook_limit_reached",
            ErrorCode::GrantScope => "grant_scope",
            ErrorCode::GrantExpired => "grant_expired",
            ErrorCode::UsageRangeInvalid => "usage_range_invalid",
            ErrorCode::SecretNotFound => "secret_not_found",
            ErrorCode::SecretNameTaken => "secret_name_taken",
            ErrorCode::NodeNotFound => "node_not_found",
            ErrorCode::NodeDraining => "node_draining",
        }
    }
}

/// Lifecycle states of a sandbox.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, ToSchema, PartialEq, Eq, Hash)]
#[serde(rename_all = "snake_case")]
pub enum SandboxState {
    Starting,
    Running,
    Suspended,
    Terminating,
    Terminated,
    /// Paused to disk: no processes, no memory; its files are kept.
    Paused,
    /// Its node was declared lost (it stopped heartbeating) while it ran:
    /// what it held there is gone for the fleet. Final, like `terminated`;
    /// its `reason` says which node and since when.
    Lost,
}

impl SandboxState {
    pub const ALL: [SandboxState; 7] = [
        SandboxState::Starting,
        SandboxState::Running,
        SandboxState::Suspended,
        SandboxState::Terminating,
        SandboxState::Terminated,
        SandboxState::Paused,
        SandboxState::Lost,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            SandboxState::Starting => "starting",
            SandboxState::Running => "running",
            SandboxState::Suspended => "suspended",
            SandboxState::Terminating => "terminating",
            SandboxState::Terminated => "terminated",
            SandboxState::Paused => "paused",
            SandboxState::Lost => "lost",
        }
    }

    pub fn parse(s: &str) -> Option<SandboxState> {
        SandboxState::ALL.into_iter().find(|st| st.as_str() == s)
    }
}

/// How a sandbox is isolated from the host and from other sandboxes.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, ToSchema, PartialEq, Eq, Hash)]
#[serde(rename_all = "snake_case")]
pub enum Class {
    /// Fresh namespaces, an overlay root, a cgroup, seccomp and a uid range
    /// of its own, on the host's kernel.
    #[default]
    Container,
    /// The container class's pieces with gVisor's user-space kernel in
    /// front of the host's.
    Gvisor,
    /// A uid, home, cgroup and Landlock domain of its own inside one
    /// container shared with its template's other sandboxes.
    Process,
    /// A virtual machine of its own (a design only: no host runs it yet).
    Microvm,
}

impl Class {
    pub const ALL: [Class; 4] = [Class::Container, Class::Gvisor, Class::Process, Class::Microvm];

    pub fn as_str(self) -> &'static str {
        match self {
            Class::Container => "container",
            Class::Gvisor => "gvisor",
            Class::Process => "process",
            Class::Microvm => "microvm",
        }
    }

    pub fn parse(s: &str) -> Option<Class> {
        Class::ALL.into_iter().find(|c| c.as_str() == s)
    }
}

impl std::fmt::Display for Class {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Where a sandbox's files live.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, ToSchema, PartialEq, Eq, Hash)]
#[serde(rename_all = "snake_case")]
pub enum StorageKind {
    /// A layer on disk under the daemon's state directory (a btrfs
    /// subvolume): `disk_mib` is its quota, it does not count toward
    /// `memory_mb`, and it can be kept beyond the sandbox's processes.
    #[default]
    Disk,
    /// A tmpfs in the sandbox's memory: a little faster to write, but its
    /// files count toward `memory_mb` and are gone with its processes.
    Memory,
}

impl StorageKind {
    pub const ALL: [StorageKind; 2] = [StorageKind::Disk, StorageKind::Memory];

    pub fn as_str(self) -> &'static str {
        match self {
            StorageKind::Disk => "disk",
            StorageKind::Memory => "memory",
        }
    }

    pub fn parse(s: &str) -> Option<StorageKind> {
        StorageKind::ALL.into_iter().find(|k| k.as_str() == s)
    }
}

/// What happens to a sandbox idle for its `idle_timeout_seconds`.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, ToSchema, PartialEq, Eq, Hash)]
#[serde(rename_all = "snake_case")]
pub enum OnIdle {
    /// It is paused: to disk when its files are on disk (state `paused`),
    /// else suspended in memory (state `suspended`); a resume wakes it.
    #[default]
    Pause,
    /// It ends and its files are deleted.
    Delete,
}

impl OnIdle {
    pub fn as_str(self) -> &'static str {
        match self {
            OnIdle::Pause => "pause",
            OnIdle::Delete => "delete",
        }
    }

    pub fn parse(s: &str) -> Option<OnIdle> {
        [OnIdle::Pause, OnIdle::Delete].into_iter().find(|o| o.as_str() == s)
    }
}

/// Longest idle timeout: a week.
pub const MAX_IDLE_SECONDS: u64 = 7 * 86_400;

/// What happens to a sandbox when its lifetime ends.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, ToSchema, PartialEq, Eq, Hash)]
#[serde(rename_all = "snake_case")]
pub enum OnExpire {
    /// It ends and its files are deleted.
    #[default]
    Delete,
    /// It is paused to disk (processes end, files kept, state `paused`)
    /// and kept for `paused_ttl_seconds`; a resume gives it its lifetime
    /// again. Disk layers only.
    Pause,
}

impl OnExpire {
    pub const ALL: [OnExpire; 2] = [OnExpire::Delete, OnExpire::Pause];

    pub fn as_str(self) -> &'static str {
        match self {
            OnExpire::Delete => "delete",
            OnExpire::Pause => "pause",
        }
    }

    pub fn parse(s: &str) -> Option<OnExpire> {
        OnExpire::ALL.into_iter().find(|k| k.as_str() == s)
    }
}

/// Resource caps requested for a sandbox.
#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct LimitsRequest {
    /// CPUs worth of time (fractions allowed), 0.05 to 64. Default 1.
    #[serde(default)]
    pub vcpus: Option<f64>,
    /// Writable layer size in MiB, 16 to 65536. Default 1024.
    #[serde(default)]
    pub disk_mib: Option<u64>,
    /// Most processes and threads at once, 16 to 65536. Default 512.
    #[serde(default)]
    pub pids: Option<u32>,
}

/// `POST /v1/sandboxes`.
#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct CreateSandbox {
    /// Template name; `base` when absent.
    #[serde(default)]
    pub template: Option<String>,
    /// Lifetime in seconds from now; the template's default when absent.
    #[serde(default)]
    pub ttl_seconds: Option<u64>,
    /// Memory limit in MiB, 64 to 262144. Default 1024.
    #[serde(default)]
    pub memory_mb: Option<u64>,
    #[serde(default)]
    pub limits: Option<LimitsRequest>,
    /// Environment of every process in the sandbox.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Free-form labels, returned as given (at most 64, each at most 256 bytes).
    #[serde(default)]
    pub metadata: BTreeMap<String, String>,
    /// Wait up to this long (0 to 60 s) for the sandbox to run before
    /// answering. Default 10.
    #[serde(default)]
    pub wait_seconds: Option<u64>,
    /// Network policy; `{"egress": "default"}` when absent.
    #[serde(default)]
    pub network: Option<NetworkRequest>,
    /// Where its files live: `disk` or `memory`; the template's choice when
    /// absent, else `disk` (`memory` on a host without disk storage).
    #[serde(default)]
    pub storage: Option<StorageKind>,
    /// Start from a snapshot (its id or name) instead of a template: its
    /// files, and the template settings of the sandbox it was taken of.
    #[serde(default)]
    pub snapshot: Option<String>,
    /// What happens at its expiry; the template's choice when absent, else
    /// `delete`.
    #[serde(default)]
    pub on_expire: Option<OnExpire>,
    /// How long a sandbox paused at its expiry keeps its files before it
    /// is deleted, 60 to 2592000 (30 days); the template's when absent,
    /// else 604800 (7 days).
    #[serde(default)]
    pub paused_ttl_seconds: Option<u64>,
    /// Pause or end it (`on_idle`) once it has had no API use and no
    /// command running for this long, 1 to 604800 (a week); none when
    /// absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idle_timeout_seconds: Option<u64>,
    /// What idleness does: `pause` (the default) or `delete`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub on_idle: Option<OnIdle>,
    /// Volumes to mount (see `POST /v1/volumes`): each by its name or id,
    /// at a path under `/workspace`, `/home/user`, `/mnt` or `/data`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub volumes: Vec<VolumeMount>,
    /// Secrets it names (see `POST /v1/secrets`), added to its template's:
    /// each appears in its environment as `NAME=hutch-secret-…`, a
    /// placeholder that the host's egress proxy replaces with the value in
    /// the headers of HTTPS requests to the secret's hosts only.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub secrets: Vec<String>,
    /// The fleet node to run it on, whatever placement would pick (an
    /// admin key only): the create goes to that node, which must be
    /// active.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
}

/// `POST /v1/secrets`: a value that never enters a sandbox.
#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct CreateSecret {
    /// Unique among the key's secrets; the name of the environment
    /// variable that holds its placeholder: 1 to 64 of `A-Z a-z 0-9 _`,
    /// not starting with a digit.
    pub name: String,
    /// The value (1 to 8192 bytes, no CR, LF or NUL). Write-only: no
    /// response ever holds it.
    pub value: String,
    /// Hosts whose HTTPS requests get the value (at most 16): exact names,
    /// or `*.example.org` for every name under it (not `example.org`
    /// itself).
    #[serde(default)]
    pub hosts: Vec<String>,
    /// A header the proxy sets on requests to those hosts, replacing any
    /// the sandbox sent, e.g. `Authorization`.
    #[serde(default)]
    pub header: Option<String>,
    /// That header's value, with `{value}` where the secret goes (default
    /// `{value}`), e.g. `Bearer {value}`.
    #[serde(default)]
    pub format: Option<String>,
}

/// `PATCH /v1/secrets/{name}`: the fields given replace the secret's.
#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct UpdateSecret {
    #[serde(default)]
    pub value: Option<String>,
    #[serde(default)]
    pub hosts: Option<Vec<String>>,
    /// `null` removes the header.
    #[serde(default, deserialize_with = "present")]
    #[schema(value_type = Option<String>)]
    pub header: Option<Option<String>>,
    #[serde(default, deserialize_with = "present")]
    #[schema(value_type = Option<String>)]
    pub format: Option<Option<String>>,
}

/// A secret as the API shows it: never its value.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq)]
pub struct Secret {
    pub name: String,
    pub hosts: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub header: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub format: Option<String>,
    /// RFC 3339, UTC.
    pub created_at: String,
    pub updated_at: String,
}

/// `GET /v1/secrets`.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq)]
pub struct SecretList {
    pub secrets: Vec<Secret>,
}

/// A volume a sandbox mounts.
#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct VolumeMount {
    /// The volume's name or id (the caller's own).
    pub name: String,
    /// Where it appears: `/workspace`, `/home/user`, `/mnt` or `/data`, or
    /// a directory under one of them.
    pub path: String,
    /// Mounted read-only: any number of sandboxes may hold a volume
    /// read-only at once, but none while one holds it read-write.
    #[serde(default)]
    pub read_only: bool,
}

/// `POST /v1/volumes`.
#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct CreateVolume {
    /// Unique among the key's volumes: 1 to 64 of `a-z 0-9 - _ .`, not
    /// starting with `vol-`.
    pub name: String,
    /// Most MiB it may hold (1 to 1048576); 1024 when absent.
    #[serde(default)]
    pub size_mib: Option<u64>,
}

/// `PATCH /v1/volumes/{id}`.
#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct UpdateVolume {
    /// A new size, at least the current one (volumes grow only).
    #[serde(default)]
    pub size_mib: Option<u64>,
}

/// A sandbox that holds a volume mounted.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq, Eq)]
pub struct VolumeHolder {
    pub sandbox_id: String,
    pub path: String,
    pub read_only: bool,
}

/// Files that outlive sandboxes, mounted by them.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq)]
pub struct Volume {
    /// `vol-` and 16 hex digits.
    pub id: String,
    pub name: String,
    /// Most MiB it may hold: writes past it fail (EDQUOT, "Disk quota
    /// exceeded").
    pub size_mib: u64,
    /// Bytes its files take now.
    pub used_bytes: u64,
    /// The sandboxes (not ended) that hold it mounted, paused ones included.
    pub mounted_by: Vec<VolumeHolder>,
    pub created_at: String,
    /// The id of the API key that owns it.
    pub owner: String,
}

/// `GET /v1/volumes`.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq)]
pub struct VolumeList {
    pub volumes: Vec<Volume>,
}

/// `POST /v1/sandboxes/{id}/suspend`.
#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Suspend {
    /// `memory` (the default): every process frozen, memory kept; `disk`:
    /// processes end, memory is released, files are kept (state `paused`;
    /// disk layers only).
    #[serde(default)]
    pub mode: Option<SuspendMode>,
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, ToSchema, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum SuspendMode {
    Memory,
    Disk,
}

/// `POST /v1/sandboxes/{id}/snapshots`.
#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct CreateSnapshot {
    /// Unique among the key's snapshots: 1 to 64 of `a-z 0-9 - _ .`, not
    /// starting with `snap-`.
    #[serde(default)]
    pub name: Option<String>,
    /// Keep the sandbox's memory and running processes too (gvisor class
    /// without a network namespace only): a sandbox created from it
    /// continues them. Default false: files only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory: Option<bool>,
}

/// `POST /v1/sandboxes/{id}/fork`.
#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Fork {
    /// How many sandboxes, 1 to 20. Default 1.
    #[serde(default)]
    pub count: Option<u32>,
}

/// The sandboxes a fork started, each with the parent's files at one
/// instant and an identity of its own.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq)]
pub struct ForkResult {
    pub sandboxes: Vec<Sandbox>,
}

/// `GET /v1/sandboxes/{id}/diff`: what the sandbox changed since it
/// started (or since another snapshot of its lineage), paths sorted.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq)]
pub struct Diff {
    pub changes: Vec<Change>,
}

/// One changed path.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq)]
pub struct Change {
    /// Absolute in the sandbox.
    pub path: String,
    /// `added`, `modified` or `deleted`.
    pub kind: String,
    /// Bytes of the file now (a symlink: of its target); absent for
    /// deletions and directories.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub size: Option<u64>,
    /// SHA-256 (hex) of the file now (a symlink: of its target).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sha256: Option<String>,
}

/// A sandbox's files at one instant.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq)]
pub struct Snapshot {
    /// `snap-` and 16 hex digits.
    pub id: String,
    pub name: Option<String>,
    /// The sandbox it was taken of (it may be gone).
    pub sandbox_id: String,
    /// Bytes its files take (shared with its sandbox and other snapshots
    /// until either changes).
    pub size_bytes: u64,
    pub created_at: String,
    /// Whether it holds the sandbox's memory and processes too (taken
    /// with `"memory": true`); else files only.
    pub memory: bool,
    /// The id of the API key that owns it.
    pub owner: String,
}

/// `GET /v1/snapshots`.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq)]
pub struct SnapshotList {
    pub snapshots: Vec<Snapshot>,
}

/// What a sandbox may reach.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, ToSchema, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Egress {
    /// The internet, but not the host, its networks, link-local addresses
    /// or other sandboxes.
    #[default]
    Default,
    /// Loopback only: no interface but `lo`, no DNS.
    DenyAll,
    /// Only the other `private` sandboxes of the same owner and template.
    Private,
}

/// A network policy as asked for.
#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct NetworkRequest {
    #[serde(default)]
    pub egress: Egress,
    /// With `default` egress: only these are reachable. CIDRs
    /// (`203.0.113.0/24`), addresses, names (`pypi.org`) and wildcards
    /// (`*.github.com`, names below it). At most 64 entries.
    #[serde(default)]
    pub allow: Vec<String>,
    /// With `default` egress: never reachable (CIDRs), never resolved (names).
    #[serde(default)]
    pub deny: Vec<String>,
}

/// A sandbox's network as the API shows it.
#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema, PartialEq)]
pub struct Network {
    pub egress: Egress,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub allow: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub deny: Vec<String>,
    /// What the daemon last observed on the host: the policy whose rules
    /// are loaded for this sandbox (`default`, `deny_all`, `private`), or
    /// `unknown` (not observed yet, or not matching).
    pub applied: String,
    /// The sandbox's addresses, when it has a network interface.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub addresses: Vec<String>,
}

/// Limits as requested and as enforced.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq)]
pub struct Limits {
    pub vcpus: f64,
    pub disk_mib: u64,
    pub pids: u32,
    /// `enforced` once the host applied every cap, `unknown` before.
    pub applied: String,
}

/// A sandbox as the API shows it.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq)]
pub struct Sandbox {
    pub id: String,
    pub template: String,
    pub state: SandboxState,
    /// RFC 3339, UTC.
    pub created_at: String,
    pub expires_at: String,
    pub memory_mb: u64,
    pub limits: Limits,
    pub metadata: BTreeMap<String, String>,
    /// The last recorded lifecycle reason, when one is known.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last_error_code: Option<String>,
    /// Claimed from its template's warm pool (its lifetime started at the claim).
    #[serde(default)]
    pub warm: bool,
    /// The template it runs (absent for `base`) and that template's version.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub template_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub template_version: Option<u64>,
    #[serde(default)]
    pub network: Network,
    /// The id of the API key that owns it.
    #[serde(default)]
    pub owner: String,
    /// How it is isolated.
    #[serde(default)]
    pub class: Class,
    /// Where its files live.
    #[serde(default)]
    pub storage: StorageKind,
    /// The snapshot it started from, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot: Option<String>,
    /// What happens at its expiry.
    #[serde(default)]
    pub on_expire: OnExpire,
    /// How long it is kept once paused at its expiry (seconds).
    #[serde(default)]
    pub paused_ttl_seconds: u64,
    /// Its idle timeout (seconds) and what idleness does, when it has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idle_timeout_seconds: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub on_idle: Option<OnIdle>,
    /// RFC 3339: since when it has had no API use and no command running;
    /// null while a command runs (or it is not running, or has no idle
    /// timeout).
    #[serde(default)]
    pub idle_since: Option<String>,
    /// The volumes it mounts (`name` is the volume's name), in the answers
    /// of a create and of `GET /v1/sandboxes/{id}`; absent when none.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub volumes: Vec<VolumeMount>,
    /// The node (`hutch serve --node`) it lives on.
    #[serde(default)]
    pub node: String,
    /// Why it is in its state, in words, when hutch knows more than
    /// `last_error_code`: for a `lost` sandbox, which node stopped
    /// heartbeating and when; for a paused one, that its node was lost.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// A node of the fleet: one `hutch serve` sharing the database
/// (`GET /v1/nodes`, admin only).
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq)]
pub struct Node {
    pub name: String,
    /// The URL it advertises for its API.
    pub advertise: String,
    /// `active`, `draining` or `lost`.
    pub state: String,
    /// RFC 3339, UTC.
    pub started_at: String,
    pub heartbeat_at: String,
    /// Milliseconds since its last heartbeat, as the answering node sees it.
    pub heartbeat_age_ms: u64,
    pub capacity: NodeCapacity,
    /// Its sandboxes that are not terminated or lost (warm ones included).
    pub sandboxes: u64,
    /// For a `draining` node: true once no sandbox names it (its paused
    /// ones moved to other nodes, the others ended or deleted): the
    /// operator may stop it. Absent for other states.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub drained: Option<bool>,
}

/// What a node may hold.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq, Eq)]
pub struct NodeCapacity {
    pub memory_mib: u64,
    pub disk_mib: u64,
    pub sandboxes: u64,
    /// The isolation classes it runs.
    pub classes: Vec<String>,
}

/// `GET /v1/nodes`.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq)]
pub struct NodeList {
    pub nodes: Vec<Node>,
}

/// A warm pool's bounds: the daemon keeps `min` sandboxes started and
/// unclaimed, and drains any beyond `max`.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, ToSchema, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct Warm {
    #[serde(default)]
    pub min: u32,
    #[serde(default)]
    pub max: u32,
}

/// `POST /v1/templates`: a named, versioned recipe for sandboxes.
#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct CreateTemplate {
    /// Unique per owner: 1 to 64 of `a-z0-9-_.`, starting with a letter or digit; not `base`.
    pub name: String,
    /// Root filesystem; only `base` for now.
    #[serde(default)]
    pub image: Option<String>,
    /// Isolation class: `container` (the default), or another class
    /// `GET /v1/capabilities` lists as available.
    #[serde(default)]
    pub class: Option<String>,
    /// Memory limit in MiB of its sandboxes, 64 to 262144. Default 1024.
    #[serde(default)]
    pub memory_mb: Option<u64>,
    #[serde(default)]
    pub limits: Option<LimitsRequest>,
    /// Environment of every process in its sandboxes (a create's `env` adds to it).
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Lifetime of a sandbox whose create gives none. Default 600.
    #[serde(default)]
    pub default_ttl_seconds: Option<u64>,
    /// Most lifetime a create or an extension may reach. Default 86400.
    #[serde(default)]
    pub max_ttl_seconds: Option<u64>,
    #[serde(default)]
    pub warm: Option<Warm>,
    /// Started in the background when one of its sandboxes boots.
    #[serde(default)]
    pub startup: Option<Startup>,
    /// What makes one of its sandboxes ready; `running` only once it passes.
    #[serde(default)]
    pub readiness: Option<Readiness>,
    /// Network policy of its sandboxes (a create's `network` replaces it);
    /// `{"egress": "default"}` when absent.
    #[serde(default)]
    pub network: Option<NetworkRequest>,
    /// Where its sandboxes' files live (a create's `storage` replaces it);
    /// the host's default (`disk` where it has disk storage) when absent.
    #[serde(default)]
    pub storage: Option<StorageKind>,
    /// What happens to its sandboxes at their expiry (a create's
    /// `on_expire` replaces it); `delete` when absent.
    #[serde(default)]
    pub on_expire: Option<OnExpire>,
    /// How long its sandboxes paused at their expiry are kept, 60 to
    /// 2592000; 604800 when absent.
    #[serde(default)]
    pub paused_ttl_seconds: Option<u64>,
    /// Its sandboxes' idle timeout and what idleness does, unless a create
    /// says (see `CreateSandbox`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idle_timeout_seconds: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub on_idle: Option<OnIdle>,
    /// Secrets its sandboxes name (a create's `secrets` add to them).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub secrets: Vec<String>,
}

/// `PATCH /v1/templates/{id}`: the fields given replace the template's. A
/// change to what runs (image, env, memory, limits) raises `version`.
#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct UpdateTemplate {
    #[serde(default)]
    pub image: Option<String>,
    #[serde(default)]
    pub class: Option<String>,
    #[serde(default)]
    pub memory_mb: Option<u64>,
    /// Replaces the limits whole (fields absent take their defaults).
    #[serde(default)]
    pub limits: Option<LimitsRequest>,
    /// Replaces the environment whole.
    #[serde(default)]
    pub env: Option<BTreeMap<String, String>>,
    #[serde(default)]
    pub default_ttl_seconds: Option<u64>,
    #[serde(default)]
    pub max_ttl_seconds: Option<u64>,
    #[serde(default)]
    pub warm: Option<Warm>,
    /// Replaces the startup command; `null` removes it. Raises the version.
    #[serde(default, deserialize_with = "present")]
    #[schema(value_type = Option<Startup>)]
    pub startup: Option<Option<Startup>>,
    /// Replaces the readiness check; `null` removes it.
    #[serde(default, deserialize_with = "present")]
    #[schema(value_type = Option<Readiness>)]
    pub readiness: Option<Option<Readiness>>,
    /// Replaces the network policy. Raises the version.
    #[serde(default)]
    pub network: Option<NetworkRequest>,
    /// Replaces where its sandboxes' files live. Raises the version.
    #[serde(default)]
    pub storage: Option<StorageKind>,
    /// Replaces what happens to its sandboxes at their expiry (sandboxes
    /// made from now on).
    #[serde(default)]
    pub on_expire: Option<OnExpire>,
    #[serde(default)]
    pub paused_ttl_seconds: Option<u64>,
    /// Replace its sandboxes' idle timeout and `on_idle` (sandboxes made
    /// from now on).
    #[serde(default)]
    pub idle_timeout_seconds: Option<u64>,
    #[serde(default)]
    pub on_idle: Option<OnIdle>,
    /// Replaces the secrets its sandboxes name. Raises the version.
    #[serde(default)]
    pub secrets: Option<Vec<String>>,
}

/// Tells a field given as `null` (`Some(None)`) from an absent one (`None`).
fn present<'de, D: serde::Deserializer<'de>, T: Deserialize<'de>>(d: D) -> Result<Option<Option<T>>, D::Error> {
    Option::<T>::deserialize(d).map(Some)
}

/// A command started in the background in every sandbox of a template as it
/// boots (as `user` unless a build's USER said `root`, in the image's
/// working directory, tagged `startup`).
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct Startup {
    /// Run with `bash -c`.
    pub command: String,
    /// `user` (the default) or `root`; set by a build's USER.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
}

/// What makes a sandbox ready: exactly one of `command` (exits 0) and
/// `port` (accepts a TCP connection on 127.0.0.1 inside the sandbox).
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct Readiness {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub command: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port: Option<u16>,
    /// How long a boot waits for it, 1 to 300. Default 30. A build's check
    /// waits at most 30.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_seconds: Option<u32>,
}

/// Where a template build is.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, ToSchema, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum BuildState {
    Queued,
    Building,
    Succeeded,
    Failed,
}

impl BuildState {
    pub fn as_str(self) -> &'static str {
        match self {
            BuildState::Queued => "queued",
            BuildState::Building => "building",
            BuildState::Succeeded => "succeeded",
            BuildState::Failed => "failed",
        }
    }

    pub fn parse(s: &str) -> Option<BuildState> {
        [BuildState::Queued, BuildState::Building, BuildState::Succeeded, BuildState::Failed]
            .into_iter()
            .find(|b| b.as_str() == s)
    }
}

/// A template build (`POST /v1/templates/{id}/builds`).
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq)]
pub struct Build {
    pub id: String,
    pub template_id: String,
    pub state: BuildState,
    /// RFC 3339, UTC.
    pub created_at: String,
    pub finished_at: Option<String>,
    /// Why it failed: the step and its exit code, or the check that did not pass.
    pub error: Option<String>,
    /// The template version it produced, once it succeeded.
    pub version: Option<u64>,
}

/// `GET /v1/templates/{id}/builds`, newest first.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq)]
pub struct BuildList {
    pub builds: Vec<Build>,
}

/// A template as the API shows it.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq)]
pub struct Template {
    pub id: String,
    pub name: String,
    pub version: u64,
    pub image: String,
    pub class: String,
    pub memory_mb: u64,
    pub limits: LimitsRequest,
    pub env: BTreeMap<String, String>,
    pub default_ttl_seconds: u64,
    pub max_ttl_seconds: u64,
    pub warm: Warm,
    /// Warm sandboxes of the current version ready to be claimed now.
    pub warm_ready: u64,
    pub startup: Option<Startup>,
    pub readiness: Option<Readiness>,
    pub network: NetworkRequest,
    /// RFC 3339, UTC.
    pub created_at: String,
    pub updated_at: String,
    /// The id of the API key that owns it.
    #[serde(default)]
    pub owner: String,
    /// Where its sandboxes' files live; absent: the host's default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub storage: Option<StorageKind>,
    /// What happens to its sandboxes at their expiry.
    #[serde(default)]
    pub on_expire: OnExpire,
    /// How long its sandboxes paused at their expiry are kept (seconds).
    #[serde(default)]
    pub paused_ttl_seconds: u64,
    /// Its sandboxes' idle timeout and what idleness does, when it has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idle_timeout_seconds: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub on_idle: Option<OnIdle>,
    /// The secrets its sandboxes name.
    #[serde(default)]
    pub secrets: Vec<String>,
}

/// `GET /v1/templates`.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq)]
pub struct TemplateList {
    pub templates: Vec<Template>,
}

/// `POST /v1/images/pull` (admin keys only).
#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct PullImage {
    /// `[registry/]repository[:tag][@sha256:digest]`, as docker takes it.
    pub reference: String,
    /// The image's name (default: the reference, lowercased, other
    /// characters turned into `-`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Allow plain HTTP to a registry that is not on loopback.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub insecure: bool,
}

/// `POST /v1/images/build` (admin keys only): a Debian image made with
/// mmdebstrap on the daemon's host, or one of the presets.
#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct BuildImage {
    /// `debian`, or a preset: `python`, `node`, `code-interpreter`.
    pub kind: String,
    /// Debian suite (`debian` only; default `bookworm`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub suite: Option<String>,
    /// Debian packages to add (`debian` only; at most 256).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub packages: Vec<String>,
    /// The image's name (`debian` only; default `debian-SUITE`). A preset
    /// is named after itself.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

/// One line of `POST /v1/images/build`'s NDJSON answer: progress lines as
/// they come, then `done` with the image or `error` with its code.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ImageBuildEvent {
    /// A line of the builder's progress (mmdebstrap's own, or ours).
    Log {
        line: String,
    },
    /// Progress lines a slow reader did not take (dropped, never queued).
    Skipped {
        lines: u64,
    },
    Done {
        image: ImageInfo,
    },
    Error {
        code: ErrorCode,
        error: String,
    },
}

/// One image of the store, in `GET /v1/images`.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq)]
pub struct ImageInfo {
    pub name: String,
    /// Layers stacked, including hutch's generated top layer.
    pub layers: u64,
    /// Bytes of the image's layers on disk (layers shared with other images
    /// are counted in each).
    pub size_bytes: u64,
    /// Where it came from: `debian:SUITE+PACKAGES`, `import:FILE`, `pull:REF`.
    pub source: String,
    /// RFC 3339.
    pub created_at: String,
}

/// `GET /v1/images`: every image of the host's store (`base` is not listed:
/// it is built in).
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq)]
pub struct ImageList {
    pub images: Vec<ImageInfo>,
}

/// `GET /v1/sandboxes`.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq)]
pub struct SandboxList {
    pub sandboxes: Vec<Sandbox>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub next_cursor: Option<String>,
}

/// One sample of a sandbox's use, taken by the daemon every five seconds
/// while it runs (`GET /v1/sandboxes/{id}/metrics`).
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq)]
pub struct MetricSample {
    /// When it was taken (RFC 3339).
    pub at: String,
    pub cpu_count: u32,
    /// CPU used since the previous sample, in percent of the sandbox's CPUs.
    pub cpu_used_pct: f64,
    pub mem_used_bytes: u64,
    pub mem_total_bytes: u64,
    pub mem_cache_bytes: u64,
    pub disk_used_bytes: u64,
    pub disk_total_bytes: u64,
}

/// `GET /v1/sandboxes/{id}/metrics`: oldest first, the last hour's at most.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq)]
pub struct SandboxMetrics {
    pub samples: Vec<MetricSample>,
}

/// `POST /v1/sandboxes/{id}/extend`: exactly one of the two.
#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Extend {
    /// Seconds to add to the current expiry.
    #[serde(default)]
    pub by: Option<u64>,
    /// New expiry, RFC 3339.
    #[serde(default)]
    pub until: Option<String>,
}

/// `POST /v1/sandboxes/{id}/exec`: exactly one of `command` and `argv`.
#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ExecRequest {
    /// A shell command line (bash -c, or sh -c without bash).
    #[serde(default)]
    pub command: Option<String>,
    /// A program and its arguments, run without a shell.
    #[serde(default)]
    pub argv: Option<Vec<String>>,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Working directory; /workspace when absent.
    #[serde(default)]
    pub cwd: Option<String>,
    /// `user` (default) or `root`; no other name is accepted.
    #[serde(default)]
    pub user: Option<String>,
    /// Kill the command's process tree after this long (1 to 86400 s), also
    /// the processes it started that outlive its main process.
    #[serde(default)]
    pub timeout_seconds: Option<u64>,
    /// Whether the result is stored for replays (default true).
    #[serde(default)]
    pub keep_output: Option<bool>,
    /// Answer at once with the pid; reattach through the process routes.
    #[serde(default)]
    pub background: Option<bool>,
    /// Data written to stdin, then closed (base64 not needed: UTF-8 text).
    #[serde(default)]
    pub stdin: Option<String>,
}

/// The result of a foreground command.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq)]
pub struct ExecResult {
    pub stdout: String,
    pub stderr: String,
    pub exit_code: i32,
    pub stdout_truncated: bool,
    pub stderr_truncated: bool,
    pub timed_out: bool,
    pub duration_ms: u64,
    pub output_kept: bool,
    /// The kernel's OOM killer ended the command (its `exit_code` is then
    /// 137): the command's processes outgrew the sandbox's memory, files it
    /// wrote to RAM-backed paths (/tmp, the writable layer) included.
    #[serde(default)]
    pub oom_killed: bool,
    /// Processes the command started were still running when it exited. They
    /// keep its command slot and its entry in `/processes` (with
    /// `main_exited`) until they end; a signal to its pid reaches them, and
    /// its timeout ends them.
    #[serde(default)]
    pub descendants_alive: bool,
}

impl ExecResult {
    /// The `exit` event of a stream that carried this result.
    pub fn exit_event(&self) -> ExecEvent {
        ExecEvent::Exit {
            exit_code: self.exit_code,
            timed_out: self.timed_out,
            duration_ms: self.duration_ms,
            oom_killed: self.oom_killed,
            descendants_alive: self.descendants_alive,
        }
    }
}

/// The answer to a background command.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq)]
pub struct Started {
    pub pid: u32,
}

/// One event of an NDJSON command stream.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ExecEvent {
    Start {
        pid: u32,
    },
    Stdout {
        data: String,
    },
    Stderr {
        data: String,
    },
    Ping,
    /// The command ended; `oom_killed` and `descendants_alive` as in [`ExecResult`].
    Exit {
        exit_code: i32,
        timed_out: bool,
        duration_ms: u64,
        #[serde(default)]
        oom_killed: bool,
        #[serde(default)]
        descendants_alive: bool,
    },
    Error {
        code: ErrorCode,
        error: String,
    },
}

/// `POST /v1/executions`: a command in a fresh sandbox.
#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ExecutionRequest {
    #[serde(default)]
    pub template: Option<String>,
    #[serde(default)]
    pub memory_mb: Option<u64>,
    #[serde(default)]
    pub limits: Option<LimitsRequest>,
    #[serde(default)]
    pub command: Option<String>,
    #[serde(default)]
    pub argv: Option<Vec<String>>,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    #[serde(default)]
    pub cwd: Option<String>,
    #[serde(default)]
    pub user: Option<String>,
    #[serde(default)]
    pub timeout_seconds: Option<u64>,
    #[serde(default)]
    pub keep_output: Option<bool>,
    #[serde(default)]
    pub stdin: Option<String>,
    /// The sandbox's network policy; `{"egress": "default"}` when absent.
    #[serde(default)]
    pub network: Option<NetworkRequest>,
    /// Where the sandbox's files live, as for `POST /v1/sandboxes`.
    #[serde(default)]
    pub storage: Option<StorageKind>,
}

/// The result of a one-shot execution.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq)]
pub struct ExecutionResult {
    pub sandbox_id: String,
    #[serde(flatten)]
    pub result: ExecResult,
}

/// A running command.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq)]
pub struct Process {
    pub pid: u32,
    pub tag: Option<String>,
    pub command: Vec<String>,
    pub user: String,
    pub cwd: String,
    /// The command's main process exited while processes it started run on:
    /// they hold its command slot, a signal to `pid` reaches all of them, and
    /// its timeout ends them.
    #[serde(default)]
    pub main_exited: bool,
    /// The main process's exit code once it exited (128 + the signal when
    /// one ended it).
    #[serde(default)]
    pub exit_code: Option<i32>,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq)]
pub struct ProcessList {
    pub processes: Vec<Process>,
}

/// `POST .../processes/{pid}/signal`.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct SignalRequest {
    /// A number (9) or a name (`SIGKILL`, `KILL`).
    pub signal: serde_json::Value,
}

/// `POST .../processes/{pid}/stdin`.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct StdinRequest {
    /// Text to write.
    #[serde(default)]
    pub data: String,
    /// Bytes to write, base64 (standard alphabet, padded), after `data`:
    /// for input that is not UTF-8.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data_base64: Option<String>,
    /// Close stdin after writing.
    #[serde(default)]
    pub eof: bool,
}

/// `POST .../files/read`.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct FileRef {
    pub path: String,
}

/// `POST .../files/write`, and the answer of `.../files/read`.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct FileData {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
    /// Base64, at most 8 MiB decoded.
    pub data: String,
}

/// One entry of a listing.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq)]
pub struct ListEntry {
    /// Relative to the listed directory.
    pub path: String,
    /// `file`, `directory`, `symlink` or `other`.
    #[serde(rename = "type")]
    pub kind: String,
    pub size: u64,
    pub mode: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sha256: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sha256_skipped: Option<String>,
    #[serde(skip_serializing_if = "std::ops::Not::not", default)]
    pub unreadable: bool,
}

/// `GET .../files/list`.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq)]
pub struct Listing {
    pub entries: Vec<ListEntry>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub next_cursor: Option<String>,
}

/// The answer to an archive upload.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq)]
pub struct ArchiveResult {
    pub path: String,
    pub files: u64,
    pub bytes: u64,
}

/// `POST .../file-parts`.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct FilePart {
    pub path: String,
    pub offset: u64,
    /// Size of the whole file.
    pub size: u64,
    /// Lowercase hex SHA-256 of the whole file.
    pub sha256: String,
    /// Base64, at most 8 MiB decoded.
    pub data: String,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq)]
pub struct FilePartResult {
    pub path: String,
    pub offset: u64,
    pub size: u64,
    pub received: u64,
    pub complete: bool,
}

/// A key's caps; absent: no cap of the key's own (the host's still apply).
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, ToSchema, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct KeyQuotas {
    /// Sandboxes not terminated at once (its templates' warm ones included).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_sandboxes: Option<u64>,
    /// Sum of their `memory_mb`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_memory_mb: Option<u64>,
    /// Sum of their `limits.disk_mib`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_disk_mib: Option<u64>,
    /// Longest lifetime of one sandbox, from its creation, extensions included.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_ttl_seconds: Option<u64>,
    /// Template builds queued or running at once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_builds: Option<u64>,
    /// Snapshots kept.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_snapshots: Option<u64>,
}

/// An API key as listed (`GET /v1/keys`, admin only).
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq)]
pub struct ApiKey {
    pub id: String,
    pub name: String,
    #[serde(default)]
    pub admin: bool,
    pub created_at: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub revoked_at: Option<String>,
    #[serde(default)]
    pub quotas: KeyQuotas,
    /// Only in the answer to a create.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub secret: Option<String>,
}

/// `POST /v1/keys` (admin only): a key that is not an admin key.
#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct CreateKey {
    /// 1 to 64 printable characters.
    pub name: String,
    /// Shape the secret as the E2B SDK expects (`e2b_` and 40 hex digits).
    #[serde(default)]
    pub e2b: bool,
    #[serde(default)]
    pub quotas: KeyQuotas,
}

/// `GET /v1/keys`.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq)]
pub struct ApiKeyList {
    pub keys: Vec<ApiKey>,
}

/// What a key holds now against its quotas (`GET /v1/usage`).
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq)]
pub struct Usage {
    pub key_id: String,
    /// Sandboxes not terminated (its templates' warm ones included).
    pub sandboxes: u64,
    pub memory_mb: u64,
    pub disk_mib: u64,
    /// Template builds queued or running.
    pub builds: u64,
    /// Snapshots kept.
    #[serde(default)]
    pub snapshots: u64,
    /// Volumes kept, and the MiB they may hold (counted in `disk_mib` too).
    #[serde(default)]
    pub volumes: u64,
    #[serde(default)]
    pub volume_mib: u64,
    pub quotas: KeyQuotas,
    /// `GET /v1/usage` only: the metered report's window (RFC 3339,
    /// `[from, to)`), grouping and rows (see [`UsageReport`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub to: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group_by: Option<UsageGroupBy>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rows: Option<Vec<UsageRow>>,
}

/// Ports 65533 and above are reserved for hutch's own use in a sandbox.
pub const MAX_ACCESS_PORT: u16 = 65532;
/// The longest an access grant lives, in seconds (also the default).
pub const MAX_ACCESS_SECONDS: u64 = 300;

/// Longest life of a grant (`POST /v1/sandboxes/{id}/grants`): a day.
pub const MAX_GRANT_SECONDS: u64 = 86_400;

/// `POST /v1/sandboxes/{id}/grants`: a credential for an end user.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct CreateGrant {
    /// What the grant allows, each at most once: `exec`, `files:read`,
    /// `files:write`, `pty`, `ports:N` (N 1 to 65532; at most 16 ports).
    pub scopes: Vec<String>,
    /// 1 to 86400 (a day); never past the sandbox's own expiry.
    pub ttl_seconds: u64,
}

/// A grant: a token an end user sends as `Authorization: Bearer` (or, to
/// the port proxy, as its access token) to reach one sandbox for the named
/// operations until `expires_at`. The daemon keeps nothing of it: the
/// token is checked against the key's grant secret, and rotating that
/// secret revokes every grant of the key.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq)]
pub struct Grant {
    /// `hg_` and base64url; shown once.
    pub token: String,
    /// The scopes, in their canonical order.
    pub scopes: Vec<String>,
    /// RFC 3339.
    pub expires_at: String,
    pub sandbox_id: String,
}

/// The answer to a rotation of a key's grant secret.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq)]
pub struct GrantSecretRotated {
    pub key_id: String,
    /// RFC 3339; every grant minted before is refused from now on.
    pub rotated_at: String,
}

/// `POST /v1/sandboxes/{id}/access`: a short-lived credential for one port.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct CreateAccess {
    /// The TCP port inside the sandbox, 1 to 65532.
    pub port: u16,
    /// 1 to 300 (the default); never past the sandbox's own expiry.
    #[serde(default)]
    pub expires_in_seconds: Option<u64>,
}

/// An access grant. The token is shown once, in the answer to its create;
/// the daemon keeps only its SHA-256.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq)]
pub struct AccessGrant {
    pub id: String,
    pub port: u16,
    /// Where the port is served: `http://<id>--<port>.sandboxes.localhost:<api port>/`.
    pub url: String,
    /// The same, for clients without wildcard DNS:
    /// `http://<api host>/v1/sandboxes/<id>/ports/<port>/`.
    pub path_url: String,
    /// Send as `X-Hutch-Sandbox-Token`, or POST it as the form field `token`
    /// to `{url}_hutch/access` for a cookie.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token: Option<String>,
    /// RFC 3339, UTC.
    pub expires_at: String,
}

/// `GET /v1/sandboxes/{id}/access`: the sandbox's live grants (no tokens).
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq)]
pub struct AccessGrantList {
    pub grants: Vec<AccessGrant>,
}

/// The API version this daemon serves (the `/v1` of its routes).
pub const API_VERSION: &str = "v1";

/// One audited call (`GET /v1/audit`): who made it, what it did, when,
/// from where and how it ended.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq)]
pub struct AuditEntry {
    /// Its place in the log, increasing.
    pub id: u64,
    pub at: String,
    pub key_id: String,
    /// The key's name when the call was made.
    pub key_name: String,
    pub method: String,
    /// The route's template, e.g. `/v1/sandboxes/{id}/exec`, or for an MCP
    /// tool call `mcp:<tool>`.
    pub route: String,
    /// The route's path parameters (the sandbox, key, template ... named).
    pub targets: BTreeMap<String, String>,
    /// The client's IP address.
    pub client: String,
    /// The HTTP status of the response (at its start, for a stream).
    pub status: u16,
    /// The error's code, for a refused or failed call.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error_code: Option<String>,
}

/// `GET /v1/audit`: newest first.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq)]
pub struct AuditList {
    pub entries: Vec<AuditEntry>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub next_cursor: Option<String>,
}

/// One event (`GET /v1/events`, the SSE stream, a webhook's body): a
/// transition or notable outcome of something the key owns.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq)]
pub struct Event {
    /// Its place in the daemon's one sequence, increasing: the cursor, and
    /// the SSE stream's `id:`.
    pub id: u64,
    /// `sandbox.created`, `sandbox.ready`, ... (docs/api.md lists them).
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sandbox_id: Option<String>,
    pub at: String,
    /// The key that owns what it is about.
    pub owner: String,
    /// The event's own fields (`code`, `expires_at`, `template_id`, ...).
    #[serde(flatten)]
    #[schema(value_type = Object)]
    pub details: serde_json::Map<String, serde_json::Value>,
}

/// `GET /v1/events`: oldest first, after the cursor.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq)]
pub struct EventList {
    pub events: Vec<Event>,
    /// The cursor of the next page (the last event's id), when there may be more.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub next_cursor: Option<String>,
}

/// `POST /v1/webhooks`.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct CreateWebhook {
    /// `https://...`, or `http://...` to an address the operator allows.
    pub url: String,
    /// Event types, or `["*"]` for all.
    pub events: Vec<String>,
    /// The signing secret (16 to 256 bytes); one is made when none is given.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret: Option<String>,
}

/// A webhook. Its secret is shown once, by its create.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq)]
pub struct Webhook {
    pub id: String,
    pub url: String,
    pub events: Vec<String>,
    pub created_at: String,
    pub owner: String,
    /// Only in the answer of its create.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq)]
pub struct WebhookList {
    pub webhooks: Vec<Webhook>,
}

/// One delivery of an event to a webhook.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq)]
pub struct Delivery {
    pub id: u64,
    pub event_id: u64,
    pub event_type: String,
    /// `pending` (tried again at `next_attempt_at`), `delivered` or
    /// `failed` (given up on).
    pub status: String,
    pub attempts: u32,
    pub created_at: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub next_attempt_at: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last_attempt_at: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last_http_status: Option<u16>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
}

/// `GET /v1/webhooks/{id}/deliveries`: newest first.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq)]
pub struct DeliveryList {
    pub deliveries: Vec<Delivery>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub next_cursor: Option<String>,
}

/// How `GET /v1/usage` groups its rows (always per key first).
#[derive(Debug, Clone, Copy, Serialize, Deserialize, ToSchema, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum UsageGroupBy {
    /// One row per key.
    Key,
    Sandbox,
    Template,
    /// Per UTC day: intervals are split at midnight.
    Day,
}

/// One row of a usage report. Times in the figures are wall-clock seconds
/// (or hours) inside the report's window.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq)]
pub struct UsageRow {
    /// The key (owner) the usage is billed to.
    pub key: String,
    /// With `group_by=sandbox` (null for volumes, which are no sandbox's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sandbox_id: Option<String>,
    /// With `group_by=template`: the template's name as the sandbox was
    /// created with (null for volumes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub template: Option<String>,
    /// With `group_by=day`: `YYYY-MM-DD` (UTC).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub day: Option<String>,
    /// Memory limit (MiB) times seconds running.
    pub memory_mib_seconds: f64,
    /// vCPU limit times seconds running.
    pub vcpu_seconds: f64,
    /// Seconds paused or suspended.
    pub paused_seconds: f64,
    /// Writable layer limit (GiB) times hours, in every state but terminated.
    pub disk_gib_hours: f64,
    /// Snapshot size (GiB) times hours kept.
    pub snapshot_gib_hours: f64,
    /// Volume size (GiB) times hours kept.
    pub volume_gib_hours: f64,
    /// Bytes the sandboxes sent out through their network link.
    pub egress_bytes: u64,
    /// Commands started (execs, E2B processes, terminals).
    pub commands: u64,
}

/// `GET /v1/usage`.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq)]
pub struct UsageReport {
    /// The window, RFC 3339: `[from, to)`.
    pub from: String,
    pub to: String,
    pub group_by: UsageGroupBy,
    pub rows: Vec<UsageRow>,
}

/// An inclusive range a create may ask for.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, ToSchema, PartialEq)]
pub struct Range {
    pub min: f64,
    pub max: f64,
}

/// The ranges of what a create may ask for on this host (its capacity
/// included: one sandbox never gets more memory than the host has).
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq)]
pub struct LimitRanges {
    pub memory_mb: Range,
    pub vcpus: Range,
    pub disk_mib: Range,
    pub pids: Range,
    /// Lifetime of a sandbox of the builtin `base` template (a template
    /// sets its own, up to `template_max_ttl_seconds`).
    pub ttl_seconds: Range,
    pub template_max_ttl_seconds: u64,
}

/// A way to isolate sandboxes, and whether this host runs it.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq)]
pub struct IsolationClass {
    pub name: String,
    pub available: bool,
    /// Why it is not available.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// A feature and whether it is on (with the reason when off).
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq)]
pub struct Feature {
    pub enabled: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// `GET /v1/capabilities`: what this host runs and allows, for the caller.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq)]
pub struct Capabilities {
    pub api_version: String,
    /// The daemon's version.
    pub version: String,
    pub classes: Vec<IsolationClass>,
    /// The class of the builtin templates and of a template that names
    /// none (`hutch serve --default-class`; `container` unless set).
    pub default_class: String,
    pub limits: LimitRanges,
    /// The calling key's quotas and what it holds (as `GET /v1/usage`).
    pub usage: Usage,
    /// `networks`, `disk_storage`, `snapshots`, `fork`, `memory_snapshots`,
    /// `secrets`, `fleet`, `console`, `mcp`, `audit`.
    pub features: BTreeMap<String, Feature>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_serialize_as_their_names() {
        for code in [ErrorCode::SandboxCommandCapacity, ErrorCode::IdempotencyConflict, ErrorCode::Internal] {
            let json = serde_json::to_string(&code).expect("serialize");
            assert_eq!(json, format!("\"{}\"", code.as_str()));
        }
        assert_eq!(ErrorCode::SandboxCommandCapacity.status(), 429);
        assert_eq!(ErrorCode::SandboxSessionNotRunning.status(), 409);
        assert_eq!(ErrorCode::AccessTokenWrongTarget.status(), 403);
        assert_eq!(ErrorCode::SandboxPortUnreachable.status(), 502);
        assert_eq!(serde_json::to_string(&ErrorCode::AccessTokenExpired).expect("json"), "\"access_token_expired\"");
    }

    #[test]
    fn unknown_fields_are_refused() {
        assert!(serde_json::from_str::<CreateSandbox>(r#"{"templat":"base"}"#).is_err());
        assert!(serde_json::from_str::<ExecRequest>(r#"{"command":"true","bogus":1}"#).is_err());
    }

    #[test]
    fn a_null_startup_removes_it_and_an_absent_one_keeps_it() {
        let absent: UpdateTemplate = serde_json::from_str("{}").expect("parse");
        assert_eq!(absent.startup, None);
        let null: UpdateTemplate = serde_json::from_str(r#"{"startup": null}"#).expect("parse");
        assert_eq!(null.startup, Some(None));
        let set: UpdateTemplate = serde_json::from_str(r#"{"readiness": {"port": 80}}"#).expect("parse");
        assert_eq!(set.readiness, Some(Some(Readiness { command: None, port: Some(80), timeout_seconds: None })));
        assert!(serde_json::from_str::<UpdateTemplate>(r#"{"startup": {"cmd": "x"}}"#).is_err());
        assert_eq!(ErrorCode::BuildInstructionRefused.status(), 400);
        assert_eq!(ErrorCode::SandboxReadinessTimeout.as_str(), "sandbox_readiness_timeout");
    }

    #[test]
    fn states_round_trip() {
        for st in SandboxState::ALL {
            assert_eq!(SandboxState::parse(st.as_str()), Some(st));
        }
    }
}
