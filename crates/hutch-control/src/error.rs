//! The control plane's errors, and the one place that maps them onto the
//! API's stable codes: [`ControlError::code`], one exhaustive match with no
//! wildcard. Errors of the agent link are mapped by one function too
//! ([`crate::files::FilesError::from_agent`]), whoever made the call.

use crate::lifecycle::Reason;
use hutch_api::{ErrorCode, SandboxState};
use hutch_store::{Exceeded, Scope};

#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    #[error("{0}")]
    Invalid(String),
    /// A usage report's `from`/`to` (the message says which and why).
    #[error("{0}")]
    UsageRange(String),
    #[error("unknown template {0:?}")]
    UnknownTemplate(String),
    #[error("no sandbox {0}")]
    NoSandbox(String),
    #[error("no template {0}")]
    NoTemplate(String),
    #[error("no API key {0}")]
    NoKey(String),
    #[error("image {0:?} is neither `base`, a preset (python, node, code-interpreter) nor an image you may name (hutch image list)")]
    NoImage(String),
    #[error("you already have a template named {0:?}")]
    TemplateNameTaken(String),
    #[error("no snapshot {0}")]
    NoSnapshot(String),
    #[error("you already have a snapshot named {0:?}")]
    SnapshotNameTaken(String),
    #[error(
        "sandbox {0} keeps its files in memory (\"storage\": \"memory\"): only disk layers are snapshotted, forked or compared"
    )]
    SnapshotUnsupported(String),
    /// What the sandbox's (or template's) isolation class cannot do.
    #[error("{0}")]
    ClassUnsupported(String),
    #[error("the host's storage for sandboxes' files is full: {0}")]
    StorageFull(String),
    /// A snapshot that cannot become an image archive (the message says why).
    #[error("{0}")]
    SnapshotNotExportable(String),
    /// Files that cannot start on another node (the message says why).
    #[error("{0}")]
    NotMovable(String),
    #[error("no process {pid} in sandbox {sandbox}")]
    NoProcess { sandbox: String, pid: u32 },
    #[error("sandbox {id} is {}, not running; the command was not sent", state.as_str())]
    NotRunning { id: String, state: SandboxState },
    #[error("sandbox {id} lives on node {node:?}; this node acts only on its own sandboxes (ask node {node:?})")]
    OtherNode { id: String, node: String },
    #[error("all {0} command slots of the sandbox are in use; nothing was started")]
    Capacity(usize),
    #[error("this Idempotency-Key was used with a different request")]
    IdempotencyConflict,
    #[error("sandbox execution outcome is unknown; the command will not be repeated")]
    OutcomeUnknown,
    #[error("sandbox failed to start; command was not executed; reason: {}", .0.as_str())]
    StartFailed(Reason),
    /// An image's layers cannot be read (one is missing or refused).
    #[error("image unavailable: {0}")]
    ImageUnavailable(String),
    /// The host cannot hold what a create asks for, now.
    #[error("the host cannot start another sandbox: {0}")]
    NoCapacity(String),
    /// An owner's quota or the host's capacity refused an admission.
    #[error("{}", describe(.0))]
    Exceeded(Exceeded),
    /// A stored refusal replayed for its Idempotency-Key.
    #[error("{message}")]
    Replayed { code: ErrorCode, message: String },
    /// A file operation's refusal, mapped by `FilesError::from_agent`.
    #[error("{0}")]
    Files(#[from] crate::files::FilesError),
    #[error("store: {0}")]
    Store(#[from] hutch_store::StoreError),
    #[error("sandbox {sandbox}: agent: {source}")]
    Agent { sandbox: String, source: hutch_runtime::agent::AgentError },
    #[error("runtime: {0}")]
    Runtime(String),
    #[error("shutting down")]
    ShuttingDown,
    /// The host cannot provide a feature the request needs.
    #[error("{0}")]
    FeatureUnavailable(String),
    /// The sandbox's `deny_all` policy forbids the request.
    #[error("sandbox {0} has no network (`deny_all`)")]
    NetworkIsolated(String),
    #[error(
        "an access token is required: send it in X-Hutch-Sandbox-Token, or POST it to <url>_hutch/access for a cookie"
    )]
    AccessTokenRequired,
    #[error("{0}")]
    AccessTokenInvalid(&'static str),
    #[error("the access token expired at {0}")]
    AccessTokenExpired(String),
    #[error("the access token is for another sandbox or port")]
    AccessTokenWrongTarget,
    #[error("sandbox {id} already has {max} live access grants; revoke some first")]
    AccessGrantCapacity { id: String, max: usize },
    #[error("no access grant {0}")]
    NoGrant(String),
    /// Nothing accepted a connection on the port (the message says which).
    #[error("{0}")]
    PortUnreachable(String),
    #[error("no build {0}")]
    NoBuild(String),
    /// A build's Dockerfile or context instruction that is not run.
    #[error("Dockerfile line {line}: {message}")]
    BuildRefused { line: usize, message: String },
    #[error("the template's startup command failed: {0}")]
    StartupFailed(String),
    #[error("the sandbox did not become ready: {0}")]
    ReadinessTimeout(String),
    /// A missing, malformed or revoked credential.
    #[error("{0}")]
    Unauthorized(&'static str),
    /// The caller's key may not do this (an admin-only operation).
    #[error("{0}")]
    Forbidden(String),
    /// The credential is a grant that does not cover this call.
    #[error("{0}")]
    GrantScope(String),
    /// The grant expired (at this RFC 3339 time).
    #[error("the grant expired at {0}")]
    GrantExpired(String),
    /// A conditional update lost: the thing changed meanwhile.
    #[error("{0}")]
    Conflict(String),
    #[error("no secret {0:?}")]
    NoSecret(String),
    #[error("you already have a secret named {0:?}")]
    SecretNameTaken(String),
    #[error("no volume {0}")]
    NoVolume(String),
    #[error("you already have a volume named {0:?}")]
    VolumeNameTaken(String),
    #[error("{0}")]
    VolumeInUse(String),
    #[error("{0}")]
    VolumePathInvalid(String),
    #[error("volume {name} holds {size_mib} MiB; a volume grows, never shrinks")]
    VolumeShrink { name: String, size_mib: u64 },
    /// The image store's refusal or failure (an import, a pull, a removal).
    #[error("{0}")]
    Image(hutch_runtime::image::ImageError),
    #[error("no watcher {0}")]
    NoWatcher(String),
    #[error("sandbox {id} already has {max} watchers; remove some first")]
    WatcherCapacity { id: String, max: usize },
    #[error("no webhook {0}")]
    NoWebhook(String),
    #[error("webhook URL refused: {0}")]
    WebhookUrl(String),
    #[error("this key has {0} webhooks, as many as it may have; delete one first")]
    WebhookLimit(u64),
    #[error("no node {0:?} (hutch node list)")]
    NoNode(String),
    /// A create sent to a node that takes no new sandboxes.
    #[error("node {node} is {}: it takes no new sandboxes; send the create to another node", if *.lost { "lost (ending what it held)" } else { "draining" })]
    NodeDraining { node: String, lost: bool },
}

fn describe(e: &Exceeded) -> String {
    let whose = match e.scope {
        Scope::Owner => "your key's quota",
        Scope::Host => "what this host can hold",
    };
    format!(
        "{}: {} in use plus {} asked exceeds {whose} of {}; nothing was created",
        e.resource.as_str(),
        e.used,
        e.asked,
        e.limit
    )
}

impl ControlError {
    /// The API code of each error: one exhaustive match, no wildcard.
    pub fn code(&self) -> ErrorCode {
        match self {
            ControlError::Invalid(_) => ErrorCode::InvalidRequest,
            ControlError::UsageRange(_) => ErrorCode::UsageRangeInvalid,
            ControlError::UnknownTemplate(_) => ErrorCode::UnknownTemplate,
            ControlError::NoSandbox(_)
            | ControlError::NoProcess { .. }
            | ControlError::NoTemplate(_)
            | ControlError::NoKey(_)
            | ControlError::NoBuild(_)
            | ControlError::NoGrant(_)
            | ControlError::NoSnapshot(_)
            | ControlError::NoWatcher(_)
            | ControlError::NoWebhook(_) => ErrorCode::NotFound,
            ControlError::WebhookUrl(_) => ErrorCode::WebhookUrlRefused,
            ControlError::WebhookLimit(_) => ErrorCode::WebhookLimitReached,
            ControlError::BuildRefused { .. } => ErrorCode::BuildInstructionRefused,
            ControlError::StartupFailed(_) => ErrorCode::SandboxStartupFailed,
            ControlError::ReadinessTimeout(_) => ErrorCode::SandboxReadinessTimeout,
            ControlError::TemplateNameTaken(_) => ErrorCode::TemplateNameTaken,
            ControlError::NoImage(_) => ErrorCode::ImageNotFound,
            ControlError::NotRunning { .. } => ErrorCode::SandboxSessionNotRunning,
            ControlError::OtherNode { .. } => ErrorCode::SandboxOnOtherNode,
            ControlError::Capacity(_) | ControlError::WatcherCapacity { .. } => ErrorCode::SandboxCommandCapacity,
            ControlError::IdempotencyConflict => ErrorCode::IdempotencyConflict,
            ControlError::OutcomeUnknown => ErrorCode::ExecutionOutcomeUnknown,
            ControlError::StartFailed(_) | ControlError::ImageUnavailable(_) => ErrorCode::SandboxStartFailed,
            ControlError::NoCapacity(_) => ErrorCode::SandboxCapacityUnavailable,
            ControlError::Exceeded(e) => match e.scope {
                Scope::Owner => ErrorCode::QuotaExceeded,
                Scope::Host => ErrorCode::SandboxCapacityUnavailable,
            },
            ControlError::Replayed { code, .. } => *code,
            ControlError::Files(f) => f.code,
            ControlError::Store(_) | ControlError::Agent { .. } | ControlError::Runtime(_) => ErrorCode::Internal,
            ControlError::ShuttingDown => ErrorCode::Unavailable,
            ControlError::FeatureUnavailable(_) => ErrorCode::FeatureUnavailable,
            ControlError::NetworkIsolated(_) => ErrorCode::SandboxNetworkIsolated,
            ControlError::AccessTokenRequired => ErrorCode::AccessTokenRequired,
            ControlError::AccessTokenInvalid(_) => ErrorCode::AccessTokenInvalid,
            ControlError::AccessTokenExpired(_) => ErrorCode::AccessTokenExpired,
            ControlError::AccessTokenWrongTarget => ErrorCode::AccessTokenWrongTarget,
            ControlError::AccessGrantCapacity { .. } => ErrorCode::AccessGrantCapacity,
            ControlError::PortUnreachable(_) => ErrorCode::SandboxPortUnreachable,
            ControlError::Unauthorized(_) => ErrorCode::Unauthorized,
            ControlError::Forbidden(_) => ErrorCode::Forbidden,
            ControlError::GrantScope(_) => ErrorCode::GrantScope,
            ControlError::GrantExpired(_) => ErrorCode::GrantExpired,
            ControlError::Conflict(_) => ErrorCode::Conflict,
            ControlError::SnapshotNameTaken(_) => ErrorCode::SnapshotNameTaken,
            ControlError::SnapshotUnsupported(_) => ErrorCode::SnapshotUnsupported,
            ControlError::ClassUnsupported(_) => ErrorCode::ClassUnsupported,
            ControlError::StorageFull(_) => ErrorCode::StorageFull,
            ControlError::SnapshotNotExportable(_) => ErrorCode::SnapshotNotExportable,
            ControlError::NotMovable(_) => ErrorCode::NotMovable,
            ControlError::NoSecret(_) => ErrorCode::SecretNotFound,
            ControlError::SecretNameTaken(_) => ErrorCode::SecretNameTaken,
            ControlError::NoVolume(_) => ErrorCode::VolumeNotFound,
            ControlError::VolumeNameTaken(_) => ErrorCode::VolumeNameTaken,
            ControlError::VolumeInUse(_) => ErrorCode::VolumeInUse,
            ControlError::VolumePathInvalid(_) => ErrorCode::VolumePathInvalid,
            ControlError::VolumeShrink { .. } => ErrorCode::VolumeShrinkRefused,
            ControlError::NoNode(_) => ErrorCode::NodeNotFound,
            ControlError::NodeDraining { .. } => ErrorCode::NodeDraining,
            ControlError::Image(e) => match e {
                hutch_runtime::image::ImageError::NotFound(_) => ErrorCode::ImageNotFound,
                hutch_runtime::image::ImageError::Invalid { .. } => ErrorCode::ImageInvalid,
                hutch_runtime::image::ImageError::LayerRefused(_) => ErrorCode::ImageLayerRefused,
                hutch_runtime::image::ImageError::Registry(_) => ErrorCode::RegistryError,
                hutch_runtime::image::ImageError::Build { .. } => ErrorCode::ImageBuildFailed,
                hutch_runtime::image::ImageError::Io { .. } => ErrorCode::Internal,
            },
        }
    }

    /// The message shown to clients: internals of a 5xx are logged, never sent.
    pub fn public_message(&self) -> String {
        public_message(self.code(), &self.to_string())
    }
}

/// What a client may read of an error: the message, or for an internal
/// error a pointer to the log (where the message goes instead). Every
/// rendering of an error to a client goes through here.
pub fn public_message(code: ErrorCode, message: &str) -> String {
    match code {
        ErrorCode::Internal => {
            tracing::error!("{message}");
            "internal error; see the server log".to_owned()
        }
        _ => message.to_owned(),
    }
}

/// A failed agent call: a refusal keeps the code the one mapping of agent
/// refusals gives it ([`crate::files::FilesError::from_agent`]); a broken
/// link is internal.
pub(crate) fn from_agent(
    sandbox: &crate::ids::SandboxId,
    e: hutch_runtime::agent::AgentError,
    access: crate::files::Access,
) -> ControlError {
    match e {
        e @ hutch_runtime::agent::AgentError::Refused { .. } => {
            ControlError::Files(crate::files::FilesError::from_agent(e, access))
        }
        // A command or path too large for one agent frame is the caller's.
        e @ hutch_runtime::agent::AgentError::RequestTooLarge(_) => ControlError::Invalid(e.to_string()),
        source => ControlError::Agent { sandbox: sandbox.to_string(), source },
    }
}

/// A failed background task (a panic or a cancellation), as an internal error.
impl From<tokio::task::JoinError> for ControlError {
    fn from(e: tokio::task::JoinError) -> ControlError {
        ControlError::Runtime(format!("task: {e}"))
    }
}

pub type Result<T> = std::result::Result<T, ControlError>;
