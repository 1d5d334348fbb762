//! The HTTP/1 accept loop (in place of `axum::serve`, which sets no timer, so a client
//! that opens connections and never finishes a request head holds each one for ever: with
//! enough of them the process runs out of descriptors and nobody else gets in). Here a
//! connection must send a whole request head within `ServerConfig::header_timeout`, and a
//! request's body must arrive within `ServerConfig::body_timeout` (`body_deadline`);
//! replies, streamed or not, take as long as they take.

use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::Request;
use futures_util::StreamExt;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;

/// Serves `router` on `listener` until `stop` resolves, then waits up to `grace` for the
/// open connections to finish their requests; those still open are left to be dropped with
/// the runtime (a client that stops reading a stream would otherwise hold a stop for ever).
pub async fn serve(
    listener: tokio::net::TcpListener,
    router: Router,
    header_timeout: Duration,
    grace: Duration,
    stop: impl std::future::Future<Output = ()>,
) -> std::io::Result<()> {
    let mut http = hyper::server::conn::http1::Builder::new();
    // No half-close support: the end of a client's input is taken as the client going
    // away, which is what cancels a request still waiting in the queue (as nginx takes a
    // client's close as an abort). A client that half-closes its side after its request
    // (`nc -N`) is therefore not answered.
    http.timer(TokioTimer::new())
        .header_read_timeout(header_timeout);
    let graceful = GracefulShutdown::new();
    let mut stop = std::pin::pin!(stop);
    loop {
        let (stream, _) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    accept_failed(e).await;
                    continue;
                }
            },
            () = &mut stop => break,
        };
        let service = TowerToHyperService::new(router.clone());
        let conn = graceful.watch(http.serve_connection(TokioIo::new(stream), service));
        tokio::spawn(async move {
            // A client that goes away or breaks the protocol ends only its connection.
            let _ = conn.await;
        });
    }
    drop(listener);
    if tokio::time::timeout(grace, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!(
            "requests still open {:.1} s after the stop: closing their connections",
            grace.as_secs_f64()
        );
    }
    Ok(())
}

/// After a failed accept: a connection reset before it was taken is nothing; anything else
/// (out of descriptors, say) waits a moment, so the loop does not spin while connections
/// close.
async fn accept_failed(e: std::io::Error) {
    use std::io::ErrorKind::{ConnectionAborted, ConnectionRefused, ConnectionReset};
    if matches!(
        e.kind(),
        ConnectionAborted | ConnectionRefused | ConnectionReset
    ) {
        return;
    }
    tracing::warn!("accept failed: {e}");
    tokio::time::sleep(Duration::from_millis(100)).await;
}

/// Middleware: the request's body must arrive whole within `limit` of the handler being
/// reached; past it the body ends in an error, which the handlers answer as an unreadable
/// body (400), and the connection is freed.
///
/// A body whose Content-Length is over the server's limit is refused at once (413): the
/// deadline's stream hides that length from the limit, which would otherwise wait for
/// bytes that may never come.
pub async fn body_deadline(
    app: std::sync::Arc<super::App>,
    req: Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    let limit = app.config.body_timeout;
    let announced = req
        .headers()
        .get(axum::http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    if let Some(n) = announced.filter(|&n| n > app.config.body_limit as u64) {
        let mut r = super::api::error(
            &app,
            axum::http::StatusCode::PAYLOAD_TOO_LARGE,
            &format!(
                "the request body is larger than this server takes ({} bytes): {n} announced",
                app.config.body_limit
            ),
            None,
        );
        // The body is not read: the connection closes after the reply.
        r.headers_mut().insert(
            axum::http::header::CONNECTION,
            axum::http::HeaderValue::from_static("close"),
        );
        return r;
    }
    let (parts, body) = req.into_parts();
    let deadline = tokio::time::Instant::now() + limit;
    let frames = body.into_data_stream();
    let timed = futures_util::stream::unfold(Some(frames), move |frames| async move {
        let mut frames = frames?;
        match tokio::time::timeout_at(deadline, frames.next()).await {
            Ok(Some(item)) => Some((item, Some(frames))),
            Ok(None) => None,
            Err(_) => Some((
                Err(axum::Error::new(format!(
                    "it did not arrive within {} s",
                    limit.as_secs_f64()
                ))),
                None,
            )),
        }
    });
    next.run(Request::from_parts(parts, Body::from_stream(timed)))
        .await
}
