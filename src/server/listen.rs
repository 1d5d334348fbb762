//! The HTTP/1 accept loop (in place of `axum::serve`, which sets no timer, so a client
//! that opens connections and never finishes a request head holds each one for ever: with
//! enough of them the process runs out of descriptors and nobody else gets in). Here a
//! connection must send a whole request head within `Timers::header`, a request's body
//! must arrive within `ServerConfig::body_timeout` (`body_deadline`), and a write to the
//! client may wait at most `Timers::write` for it to read (a client that asked for a long
//! stream and stopped reading it would otherwise hold its connection, and the events queued
//! for it, for as long as the process runs). Replies that the client reads take as long as
//! they take.

use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::Request;
use futures_util::StreamExt;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio_io_timeout::TimeoutStream;

/// The connections' timers (`ServerConfig`'s).
#[derive(Clone, Copy, Debug)]
pub struct Timers {
    /// For a whole request head (also while idle between requests).
    pub header: Duration,
    /// For one write to the client to make progress: past it the connection is closed,
    /// which drops its reply (a stream's request is then cancelled, its slot freed).
    pub write: Duration,
    /// How long a stop waits for the open requests.
    pub grace: Duration,
}

/// Serves `router` on `listener` until `stop` resolves, then waits up to `timers.grace` for
/// the open connections to finish their requests; those still open are left to be dropped
/// with the runtime.
pub async fn serve(
    listener: tokio::net::TcpListener,
    router: Router,
    timers: Timers,
    stop: impl std::future::Future<Output = ()>,
) -> std::io::Result<()> {
    let mut http = hyper::server::conn::http1::Builder::new();
    // No half-close support: the end of a client's input is taken as the client going
    // away, which is what cancels a request still waiting in the queue (as nginx takes a
    // client's close as an abort). A client that half-closes its side after its request
    // (`nc -N`) is therefore not answered.
    http.timer(TokioTimer::new())
        .header_read_timeout(timers.header);
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
        // A write still pending after `timers.write` fails with TimedOut, which ends the
        // connection as a client going away would.
        let mut stream = TimeoutStream::new(stream);
        stream.set_write_timeout(Some(timers.write));
        let io = TokioIo::new(Box::pin(stream));
        let service = TowerToHyperService::new(router.clone());
        let conn = graceful.watch(http.serve_connection(io, service));
        tokio::spawn(async move {
            // A client that goes away or breaks the protocol ends only its connection.
            let _ = conn.await;
        });
    }
    drop(listener);
    if tokio::time::timeout(timers.grace, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!(
            "requests still open {:.1} s after the stop: closing their connections",
            timers.grace.as_secs_f64()
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::Instant;

    /// Sets its flag when dropped: the reply holding it was let go of.
    struct Dropped(Arc<AtomicBool>);

    impl Drop for Dropped {
        fn drop(&mut self) {
            self.0.store(true, Ordering::SeqCst);
        }
    }

    /// A client that asks for an endless reply and reads none of it: once the socket
    /// buffers are full the server's write waits, and after the write timeout the
    /// connection is closed and the reply dropped (for a stream, what cancels its request).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_client_that_stops_reading_is_let_go_after_the_write_timeout() {
        let dropped = Arc::new(AtomicBool::new(false));
        let flag = dropped.clone();
        let router = Router::new().route(
            "/",
            axum::routing::get(move || {
                let guard = Dropped(flag.clone());
                async move {
                    let chunk = axum::body::Bytes::from(vec![b'x'; 1 << 16]);
                    Body::from_stream(futures_util::stream::repeat_with(move || {
                        let _held = &guard;
                        Ok::<_, std::io::Error>(chunk.clone())
                    }))
                }
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let timers = Timers {
            header: Duration::from_secs(5),
            write: Duration::from_millis(500),
            grace: Duration::from_secs(1),
        };
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(serve(listener, router, timers, async move {
            let _ = stopped.await;
        }));
        // (Before the request: the server's timer cannot start before this.)
        let started = Instant::now();
        let mut client = std::net::TcpStream::connect(addr).unwrap();
        client
            .write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            .unwrap();
        while !dropped.load(Ordering::SeqCst) {
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "the reply to a client that reads nothing is still held"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let waited = started.elapsed();
        assert!(
            waited >= Duration::from_millis(500),
            "let go after {waited:?}"
        );
        // The connection is closed: reading drains what was sent and ends.
        client
            .set_read_timeout(Some(Duration::from_secs(20)))
            .unwrap();
        let drained =
            tokio::task::block_in_place(|| std::io::copy(&mut client, &mut std::io::sink()));
        assert!(drained.is_ok(), "still open: {drained:?}");
        stop.send(()).unwrap();
        server.await.unwrap().unwrap();
    }
}
