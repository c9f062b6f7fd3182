//! The event and webhook routes: `/v1/events`, `/v1/events/stream` (server-
//! sent events) and `/v1/webhooks`. Parsing and rendering only; the control
//! plane owns events and webhooks (hutch-control's `events.rs`,
//! `webhooks.rs`).

use crate::extract::{ApiPath, ApiQuery};
use crate::routes::Caller;
use crate::{ApiResult, App, JsonBody};
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::middleware;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Extension, Json, Router};
use hutch_api::{CreateWebhook, DeliveryList, EventList, Webhook, WebhookList};
use hutch_control::events::Filter;
use serde::Deserialize;
use std::sync::Arc;
use std::time::Duration;

type AppState = State<Arc<App>>;

/// Events a stream holds for its client at most (then it waits, and the
/// live feed it follows falls back to the store).
const STREAM_BUFFER: usize = 64;
/// A comment line this often keeps proxies from closing a quiet stream.
const HEARTBEAT: Duration = Duration::from_secs(15);

pub fn router(app: Arc<App>) -> Router<Arc<App>> {
    Router::new()
        .route("/v1/events", get(list))
        .route("/v1/events/stream", get(stream))
        .route("/v1/webhooks", get(list_webhooks).post(create_webhook))
        .route("/v1/webhooks/{id}", get(get_webhook).delete(delete_webhook))
        .route("/v1/webhooks/{id}/deliveries", get(deliveries))
        .route_layer(middleware::from_fn_with_state(app, crate::routes::authenticate))
}

#[derive(Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
pub(crate) struct EventQuery {
    /// Event types, comma-separated.
    #[serde(rename = "type")]
    kind: Option<String>,
    /// Only this sandbox's.
    sandbox: Option<String>,
    /// RFC 3339 bounds of `at`, inclusive.
    from: Option<String>,
    to: Option<String>,
    /// The `next_cursor` of the previous page (an event id: those after it).
    cursor: Option<String>,
    /// 1 to 1000 (default 100).
    limit: Option<u32>,
    /// Another key's events: admin keys only.
    owner: Option<String>,
}

impl EventQuery {
    fn filter(&self) -> Filter<'_> {
        Filter {
            kinds: self.kind.as_deref(),
            sandbox: self.sandbox.as_deref(),
            from: self.from.as_deref(),
            to: self.to.as_deref(),
            cursor: self.cursor.as_deref(),
            limit: self.limit,
            owner: self.owner.as_deref(),
        }
    }
}

#[utoipa::path(get, path = "/v1/events", params(EventQuery),
    responses((status = 200, body = EventList), (status = 400, body = hutch_api::ErrorBody),
              (status = 403, body = hutch_api::ErrorBody)))]
pub(crate) async fn list(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    ApiQuery(q): ApiQuery<EventQuery>,
) -> ApiResult<Json<EventList>> {
    Ok(Json(app.control.events(&caller, &q.filter()).await?))
}

/// The id a client resumes after: `Last-Event-ID`, else `cursor`.
fn resume_point(headers: &HeaderMap, cursor: Option<&str>) -> Result<Option<u64>, hutch_control::ControlError> {
    let raw = match headers.get("last-event-id") {
        Some(v) => Some(v.to_str().map_err(|_| bad_id())?.to_owned()),
        None => cursor.map(str::to_owned),
    };
    raw.map(|r| r.trim().parse::<u64>().map_err(|_| bad_id())).transpose()
}

fn bad_id() -> hutch_control::ControlError {
    hutch_control::ControlError::Invalid("Last-Event-ID (or cursor) must be an event id".into())
}

/// Server-sent events: each event as `id: <id>`, `event: <type>`,
/// `data: <json>`; from the store after `Last-Event-ID` (or `cursor`),
/// then live; without either, from now. A comment every 15 s.
#[utoipa::path(get, path = "/v1/events/stream", params(EventQuery),
    responses((status = 200, content_type = "text/event-stream", description = "the events, as server-sent events"),
              (status = 400, body = hutch_api::ErrorBody)))]
pub(crate) async fn stream(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    headers: HeaderMap,
    ApiQuery(q): ApiQuery<EventQuery>,
) -> ApiResult<Response> {
    let last = resume_point(&headers, q.cursor.as_deref())?;
    let f = Filter { cursor: None, ..q.filter() };
    let filter = app.control.event_stream_filter(&caller, &f)?;
    let (tx, rx) = tokio::sync::mpsc::channel(STREAM_BUFFER);
    let control = app.control.clone();
    tokio::spawn(async move { control.follow_events(filter, last, tx).await });
    let events = futures_stream(rx);
    Ok(Sse::new(events).keep_alive(KeepAlive::new().interval(HEARTBEAT).text("heartbeat")).into_response())
}

/// The channel as a stream of SSE events.
fn futures_stream(
    rx: tokio::sync::mpsc::Receiver<hutch_api::Event>,
) -> impl futures_core::Stream<Item = Result<SseEvent, std::convert::Infallible>> {
    struct S(tokio::sync::mpsc::Receiver<hutch_api::Event>);
    impl futures_core::Stream for S {
        type Item = Result<SseEvent, std::convert::Infallible>;
        fn poll_next(
            mut self: std::pin::Pin<&mut Self>,
            cx: &mut std::task::Context<'_>,
        ) -> std::task::Poll<Option<Self::Item>> {
            self.0.poll_recv(cx).map(|e| {
                e.map(|e| {
                    let data = serde_json::to_string(&e).unwrap_or_default();
                    Ok(SseEvent::default().id(e.id.to_string()).event(e.kind.clone()).data(data))
                })
            })
        }
    }
    S(rx)
}

#[utoipa::path(post, path = "/v1/webhooks", request_body = CreateWebhook,
    responses((status = 201, body = Webhook, description = "made; the answer holds its secret, shown once"),
              (status = 400, body = hutch_api::ErrorBody), (status = 429, body = hutch_api::ErrorBody)))]
pub(crate) async fn create_webhook(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    JsonBody(req): JsonBody<CreateWebhook>,
) -> ApiResult<Response> {
    let w = app.control.create_webhook(&caller, &req).await?;
    let id = w.id.clone();
    Ok(crate::audit::created((StatusCode::CREATED, Json(w)).into_response(), id))
}

#[utoipa::path(get, path = "/v1/webhooks", responses((status = 200, body = WebhookList)))]
pub(crate) async fn list_webhooks(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
) -> ApiResult<Json<WebhookList>> {
    Ok(Json(app.control.list_webhooks(&caller).await?))
}

#[utoipa::path(get, path = "/v1/webhooks/{id}", params(("id" = String, Path)),
    responses((status = 200, body = Webhook), (status = 404, body = hutch_api::ErrorBody)))]
pub(crate) async fn get_webhook(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    ApiPath(id): ApiPath<String>,
) -> ApiResult<Json<Webhook>> {
    Ok(Json(app.control.get_webhook(&caller, &id).await?))
}

#[utoipa::path(delete, path = "/v1/webhooks/{id}", params(("id" = String, Path)),
    responses((status = 204, description = "deleted; its pending deliveries are not sent"),
              (status = 404, body = hutch_api::ErrorBody)))]
pub(crate) async fn delete_webhook(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    ApiPath(id): ApiPath<String>,
) -> ApiResult<StatusCode> {
    app.control.delete_webhook(&caller, &id).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[derive(Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
pub(crate) struct DeliveryQuery {
    /// The `next_cursor` of the previous page.
    cursor: Option<String>,
    /// 1 to 1000 (default 100).
    limit: Option<u32>,
}

#[utoipa::path(get, path = "/v1/webhooks/{id}/deliveries", params(("id" = String, Path), DeliveryQuery),
    responses((status = 200, body = DeliveryList), (status = 404, body = hutch_api::ErrorBody)))]
pub(crate) async fn deliveries(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    ApiPath(id): ApiPath<String>,
    ApiQuery(q): ApiQuery<DeliveryQuery>,
) -> ApiResult<Json<DeliveryList>> {
    Ok(Json(app.control.webhook_deliveries(&caller, &id, q.cursor.as_deref(), q.limit).await?))
}
