//! `POST /v1/nodes/{name}/drain` and `/undrain`: an operator takes a node
//! out of placement (admin keys only; see `hutch_control::fleet`).

use crate::extract::ApiPath;
use crate::{ApiResult, App};
use axum::extract::State;
use axum::{Extension, Json};
use hutch_control::fleet::Drain;
use hutch_control::Caller;
use std::sync::Arc;

type AppState = State<Arc<App>>;

#[utoipa::path(post, path = "/v1/nodes/{name}/drain", params(("name" = String, Path)),
    responses((status = 200, body = hutch_api::Node, description = "the node, now draining: it takes no new sandboxes and moves its paused ones to other nodes"),
              (status = 403, body = hutch_api::ErrorBody), (status = 404, body = hutch_api::ErrorBody),
              (status = 409, body = hutch_api::ErrorBody, description = "the node is lost")))]
pub(crate) async fn drain_node(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    ApiPath(name): ApiPath<String>,
) -> ApiResult<Json<hutch_api::Node>> {
    Ok(Json(app.control.drain_node(&caller, &name, Drain::Drain).await?))
}

#[utoipa::path(post, path = "/v1/nodes/{name}/undrain", params(("name" = String, Path)),
    responses((status = 200, body = hutch_api::Node, description = "the node, active again"),
              (status = 403, body = hutch_api::ErrorBody), (status = 404, body = hutch_api::ErrorBody),
              (status = 409, body = hutch_api::ErrorBody, description = "the node is lost")))]
pub(crate) async fn undrain_node(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    ApiPath(name): ApiPath<String>,
) -> ApiResult<Json<hutch_api::Node>> {
    Ok(Json(app.control.drain_node(&caller, &name, Drain::Undrain).await?))
}
