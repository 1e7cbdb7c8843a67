//! The route table, the API-key check, and the small read-only endpoints.

use super::error::ApiError;
use super::{chat, completions, tokenize, ServerState};
use crate::engine::metrics::prometheus_text;
use axum::extract::{Path, Request, State};
use axum::http::{header, StatusCode, Uri};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::json;
use std::fmt::Write as _;

pub fn router(state: ServerState) -> Router {
    // The origins were checked when the server started (`kestrel serve` refuses bad ones).
    let cors = super::cors::layer(&state.allowed_origins).unwrap_or_else(|err| {
        eprintln!("kestrel serve: CORS is off: {err}");
        None
    });
    let protected = Router::new()
        .route("/v1/models", get(list_models))
        .route("/v1/models/{model}", get(get_model))
        .route("/v1/completions", post(completions::completions))
        .route("/v1/chat/completions", post(chat::chat_completions))
        .route("/tokenize", post(tokenize::tokenize))
        .route("/detokenize", post(tokenize::detokenize))
        .route("/metrics", get(metrics))
        .route_layer(middleware::from_fn_with_state(state.clone(), require_api_key));
    let app = Router::new()
        .merge(protected)
        .route("/health", get(health))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(axum::extract::DefaultBodyLimit::max(state.body_limit.0))
        .with_state(state);
    // Outermost, so that a browser's preflight is answered before the API-key check.
    match cors {
        Some(cors) => app.layer(cors),
        None => app,
    }
}

async fn require_api_key(State(state): State<ServerState>, request: Request, next: Next) -> Response {
    let Some(expected) = state.api_key.as_deref() else {
        return next.run(request).await;
    };
    let presented = request.headers().get(header::AUTHORIZATION).and_then(|value| value.to_str().ok()).and_then(|value| value.strip_prefix("Bearer "));
    match presented {
        Some(key) if equal_in_constant_time(key.trim().as_bytes(), expected.as_bytes()) => next.run(request).await,
        _ => ApiError::unauthorized().into_response(),
    }
}

/// Compares without stopping at the first difference, so response timing says nothing about
/// how much of a guessed key was right.
fn equal_in_constant_time(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |diff, (x, y)| diff | (x ^ y)) == 0
}

async fn not_found(uri: Uri) -> ApiError {
    ApiError::not_found(uri.path())
}

async fn method_not_allowed(method: axum::http::Method, uri: Uri) -> ApiError {
    ApiError::method_not_allowed(method.as_str(), uri.path())
}

async fn health(State(state): State<ServerState>) -> Response {
    if state.engine.snapshot().alive {
        Json(json!({"status": "ok"})).into_response()
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, Json(json!({"status": "engine stopped"}))).into_response()
    }
}

fn model_card(state: &ServerState) -> serde_json::Value {
    json!({
        "id": &*state.model_name,
        "object": "model",
        "created": state.started_at,
        "owned_by": "kestrel",
        "max_model_len": state.engine.info().max_model_len,
    })
}

async fn list_models(State(state): State<ServerState>) -> Json<serde_json::Value> {
    Json(json!({"object": "list", "data": [model_card(&state)]}))
}

async fn get_model(State(state): State<ServerState>, Path(model): Path<String>) -> Result<Json<serde_json::Value>, ApiError> {
    if model == *state.model_name {
        Ok(Json(model_card(&state)))
    } else {
        Err(ApiError { status: StatusCode::NOT_FOUND, ..ApiError::unknown_model(&model, &state.model_name) })
    }
}

/// Prometheus text: the speculation counters (with per-position acceptance), engine gauges,
/// request counters and the prefix cache's hit rate and cached tokens.
async fn metrics(State(state): State<ServerState>) -> Result<Response, ApiError> {
    let snapshot = state.engine.snapshot();
    // All zeros when prefix caching is off.
    let cache = snapshot.prefix_cache.clone().unwrap_or_default();
    let gauges = [
        ("kestrel_requests_running", "Requests in the running batch.", snapshot.running as f64),
        ("kestrel_requests_waiting", "Requests queued for admission.", snapshot.waiting as f64),
        ("kestrel_kv_blocks_used", "KV-cache blocks in use.", snapshot.kv_blocks_used as f64),
        ("kestrel_kv_blocks_total", "KV-cache blocks allocated.", snapshot.kv_blocks_total as f64),
        ("kestrel_state_slots_used", "Recurrent-state slots in use.", snapshot.state_slots_used as f64),
        ("kestrel_state_slots_total", "Recurrent-state slots allocated.", snapshot.state_slots_total as f64),
        ("kestrel_generation_tokens_per_second", "Generated tokens per second over the last seconds.", snapshot.tokens_per_second),
        ("kestrel_spec_acceptance_rate", "Accepted drafts over drafted tokens.", snapshot.spec.acceptance_rate()),
        ("kestrel_spec_mean_acceptance_length", "Tokens per draft step, the bonus token included.", snapshot.spec.mean_acceptance_length()),
        ("kestrel_engine_alive", "1 while the engine worker runs.", if snapshot.alive { 1.0 } else { 0.0 }),
        ("kestrel_prefix_cache_hit_rate", "Prompt tokens served from the prefix cache over prompt tokens looked up.", cache.hit_rate()),
        ("kestrel_prefix_cache_checkpoints", "Recurrent-state checkpoints the prefix cache holds.", cache.checkpoints as f64),
        ("kestrel_prefix_cache_checkpoint_capacity", "Recurrent-state checkpoints the prefix cache may hold.", cache.checkpoint_capacity as f64),
        ("kestrel_prefix_cache_blocks", "KV blocks registered in the prefix cache.", cache.cached_blocks as f64),
        ("kestrel_prefix_cache_shared_blocks", "KV blocks held by more than one running request.", cache.shared_blocks as f64),
    ];
    let mut text = prometheus_text(&snapshot.spec, &gauges).map_err(|err| ApiError::internal(err.to_string()))?;
    let counters = [
        ("kestrel_engine_steps_total", "Engine steps run.", snapshot.steps),
        ("kestrel_preemptions_total", "Requests preempted for lack of cache.", snapshot.preemptions),
        ("kestrel_generated_tokens_total", "Tokens generated.", snapshot.generated_tokens),
        ("kestrel_requests_accepted_total", "Requests the engine accepted.", snapshot.requests_accepted),
        ("kestrel_requests_rejected_total", "Requests the engine refused.", snapshot.requests_rejected),
        ("kestrel_requests_finished_total", "Requests finished, cancelled ones included.", snapshot.requests_finished),
        ("kestrel_requests_cancelled_total", "Requests cancelled (client gone or stop string).", snapshot.requests_cancelled),
        ("kestrel_requests_failed_total", "Requests ended by an error after they started.", snapshot.requests_failed),
        ("kestrel_prefix_cache_queries_total", "Admissions that looked for a cached prefix.", cache.queries),
        ("kestrel_prefix_cache_hits_total", "Admissions that resumed from a cached prefix.", cache.hits),
        ("kestrel_prefix_cache_queried_tokens_total", "Prompt tokens of the admissions that looked for a cached prefix.", cache.queried_tokens),
        ("kestrel_prefix_cache_cached_tokens_total", "Prompt tokens served from the prefix cache instead of being computed.", cache.cached_tokens),
        ("kestrel_prefix_cache_evicted_checkpoints_total", "Checkpoints evicted to make room for newer ones.", cache.evicted_checkpoints),
    ];
    for (name, help, value) in counters {
        // Writing into a String cannot fail.
        let _ = write!(text, "# HELP {name} {help}\n# TYPE {name} counter\n{name} {value}\n");
    }
    Ok(([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], text).into_response())
}

#[cfg(test)]
mod tests {
    use super::equal_in_constant_time;

    #[test]
    fn key_comparison() {
        assert!(equal_in_constant_time(b"secret", b"secret"));
        assert!(!equal_in_constant_time(b"secret", b"secreT"));
        assert!(!equal_in_constant_time(b"secret", b"secret2"));
        assert!(!equal_in_constant_time(b"", b"x"));
    }
}
