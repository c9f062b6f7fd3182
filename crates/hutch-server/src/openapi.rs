//! The OpenAPI document, generated from the handlers' annotations and the
//! wire types; served at `/v1/openapi.json`.

use axum::Json;
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::{Modify, OpenApi};

#[derive(OpenApi)]
#[openapi(
    info(title = "hutch", description = "The native API of hutch, a sandbox host for code you do not trust."),
    paths(
        crate::routes::create_sandbox,
        crate::routes::list_sandboxes,
        crate::routes::get_sandbox,
        crate::routes::delete_sandbox,
        crate::routes::extend_sandbox,
        crate::routes::suspend_sandbox,
        crate::routes::resume_sandbox,
        crate::routes::sandbox_metrics,
        crate::routes::exec,
        crate::routes::processes,
        crate::routes::signal,
        crate::routes::stdin,
        crate::routes::stream,
        crate::routes::execution,
        crate::routes::files_get,
        crate::routes::files_put,
        crate::routes::files_read,
        crate::routes::files_write,
        crate::routes::files_list,
        crate::routes::archive_upload,
        crate::routes::archive_download,
        crate::routes::file_part,
        crate::templates::create_template,
        crate::templates::list_templates,
        crate::templates::get_template,
        crate::templates::update_template,
        crate::templates::delete_template,
        crate::templates::list_images,
        crate::images::import_image,
        crate::images::pull_image,
        crate::images::build_image,
        crate::images::delete_image,
        crate::images::collect_images,
        crate::access::create,
        crate::access::list,
        crate::access::revoke,
        crate::access::revoke_all,
        crate::templates::start_build,
        crate::templates::list_builds,
        crate::templates::get_build,
        crate::templates::build_logs,
        crate::routes::list_keys,
        crate::routes::list_nodes,
        crate::nodes::drain_node,
        crate::nodes::undrain_node,
        crate::routes::create_key,
        crate::routes::revoke_key,
        crate::routes::set_quotas,
        crate::routes::create_grant,
        crate::routes::rotate_grant_secret,
        crate::routes::usage,
        crate::routes::capabilities,
        crate::audit::list,
        crate::snapshots::create,
        crate::snapshots::fork,
        crate::snapshots::diff,
        crate::snapshots::list,
        crate::snapshots::get_one,
        crate::snapshots::delete_one,
        crate::snapshots::export,
        crate::volumes::create,
        crate::volumes::list,
        crate::volumes::get_one,
        crate::volumes::update,
        crate::volumes::delete_one,
        crate::events::list,
        crate::events::stream,
        crate::events::create_webhook,
        crate::events::list_webhooks,
        crate::events::get_webhook,
        crate::events::delete_webhook,
        crate::events::deliveries,
        crate::secrets::create,
        crate::secrets::list,
        crate::secrets::get_one,
        crate::secrets::update,
        crate::secrets::delete_one,
    ),
    components(schemas(
        hutch_api::MetricSample, hutch_api::SandboxMetrics,
        hutch_api::ErrorBody, hutch_api::ErrorCode, hutch_api::Sandbox, hutch_api::SandboxList, hutch_api::SandboxState,
        hutch_api::CreateSandbox, hutch_api::LimitsRequest, hutch_api::Limits, hutch_api::Extend, hutch_api::ExecRequest,
        hutch_api::ExecResult, hutch_api::ExecEvent, hutch_api::Started, hutch_api::ExecutionRequest,
        hutch_api::ExecutionResult, hutch_api::Process, hutch_api::ProcessList, hutch_api::SignalRequest,
        hutch_api::StdinRequest, hutch_api::FileRef, hutch_api::FileData, hutch_api::ListEntry, hutch_api::Listing,
        hutch_api::ArchiveResult, hutch_api::FilePart, hutch_api::FilePartResult,
        hutch_api::Template, hutch_api::CreateTemplate, hutch_api::UpdateTemplate, hutch_api::Warm,
        hutch_api::TemplateList, hutch_api::ImageInfo, hutch_api::ImageList, hutch_api::PullImage, hutch_api::BuildImage, hutch_api::ImageBuildEvent,
        crate::images::Collected,
        hutch_api::CreateAccess, hutch_api::AccessGrant, hutch_api::AccessGrantList, hutch_api::NetworkRequest,
        hutch_api::Network, hutch_api::Egress,
        hutch_api::TemplateList, hutch_api::Startup, hutch_api::Readiness, hutch_api::Build, hutch_api::BuildState,
        hutch_api::BuildList, hutch_api::ApiKey, hutch_api::ApiKeyList, hutch_api::NodeList, hutch_api::Node, hutch_api::NodeCapacity, hutch_api::CreateKey, hutch_api::KeyQuotas,
        hutch_api::Usage, hutch_api::Class, hutch_api::CreateSnapshot, hutch_api::Snapshot, hutch_api::SnapshotList, hutch_api::CreateVolume, hutch_api::UpdateVolume, hutch_api::Volume, hutch_api::VolumeList, hutch_api::VolumeHolder, hutch_api::VolumeMount, hutch_api::CreateSecret, hutch_api::UpdateSecret, hutch_api::Secret, hutch_api::SecretList, hutch_api::Fork, hutch_api::ForkResult, hutch_api::Suspend, hutch_api::SuspendMode, hutch_api::Diff, hutch_api::Capabilities, hutch_api::LimitRanges, hutch_api::Range, hutch_api::IsolationClass, hutch_api::Feature, hutch_api::AuditEntry, hutch_api::AuditList, hutch_api::UsageGroupBy, hutch_api::UsageRow, hutch_api::UsageReport,
        hutch_api::Change,
        hutch_api::StorageKind,
        hutch_api::OnExpire,
        hutch_api::Event, hutch_api::EventList, hutch_api::CreateWebhook, hutch_api::Webhook, hutch_api::WebhookList,
        hutch_api::Delivery, hutch_api::DeliveryList,
        hutch_api::OnIdle,
        hutch_api::CreateGrant, hutch_api::Grant, hutch_api::GrantSecretRotated,
    )),
    modifiers(&BearerAuth),
    security(("bearer" = []))
)]
struct Doc;

struct BearerAuth;

impl Modify for BearerAuth {
    fn modify(&self, api: &mut utoipa::openapi::OpenApi) {
        if let Some(c) = api.components.as_mut() {
            c.add_security_scheme(
                "bearer",
                SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
            );
        }
    }
}

pub fn document() -> Json<utoipa::openapi::OpenApi> {
    Json(Doc::openapi())
}
