//! E2B's lifecycle webhooks (`/events/webhooks`): register, list, get,
//! update (`PATCH`: `enabled`, `url`, `events`, `name`) and delete, as
//! E2B's docs call them, over the same webhooks, deliveries and rules as
//! `/v1/webhooks`. Deliveries carry E2B's payload and `e2b-signature`
//! (the control plane's `webhooks.rs`; differences in docs/e2b.md).

use super::control::{authenticate, body};
use super::E2bError;
use super::E2bPath as ApiPath;
use crate::routes::Caller;
use crate::App;
use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::middleware;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Extension, Json, Router};
use hutch_control::webhooks::{E2bWebhook, E2bWebhookRequest};
use std::sync::Arc;

type AppState = State<Arc<App>>;
type E2bResult<T> = Result<T, E2bError>;

pub fn router(app: Arc<App>) -> Router<Arc<App>> {
    Router::new()
        .route("/events/webhooks", get(list).post(create))
        .route("/events/webhooks/{id}", get(get_one).patch(update).delete(delete_one))
        .route_layer(middleware::from_fn_with_state(app, authenticate))
}

async fn create(State(app): AppState, Extension(caller): Extension<Caller>, req: Request) -> E2bResult<Response> {
    let new: E2bWebhookRequest = body(req).await?;
    let w = app.control.e2b_create_webhook(&caller, new).await?;
    Ok((StatusCode::CREATED, Json(w)).into_response())
}

async fn list(State(app): AppState, Extension(caller): Extension<Caller>) -> E2bResult<Json<Vec<E2bWebhook>>> {
    Ok(Json(app.control.e2b_webhooks(&caller).await?))
}

async fn get_one(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    ApiPath(id): ApiPath<String>,
) -> E2bResult<Json<E2bWebhook>> {
    Ok(Json(app.control.e2b_webhook(&caller, &id).await?))
}

async fn update(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    ApiPath(id): ApiPath<String>,
    req: Request,
) -> E2bResult<Json<E2bWebhook>> {
    let u: E2bWebhookRequest = body(req).await?;
    Ok(Json(app.control.e2b_update_webhook(&caller, &id, u).await?))
}

async fn delete_one(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    ApiPath(id): ApiPath<String>,
) -> E2bResult<StatusCode> {
    app.control.e2b_delete_webhook(&caller, &id).await?;
    Ok(StatusCode::NO_CONTENT)
}
