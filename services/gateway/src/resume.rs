//! Resumable streams (docs/gateway.md#resuming-a-stream): a caller whose connection broke
//! (the gateway replica died, a proxy cut it) asks any replica for the rest of its stream.
//!
//! The records of every answer stay on the durable response topic, so the rest of a stream
//! need not be kept anywhere: a resume reads the request's records again from the topic (from
//! a position before its first record, see `ResponseStream::resume_after`) and builds the
//! same events from them, in the same order, skipping as many as the caller had. Nothing is
//! lost, nothing is repeated, and every byte of an event is the same as the first time: the
//! values that are not derived from the records (the stream's start time, its trace id) ride
//! in the token.
//!
//! A stream's token is `v1.<route>.<position>.<created>.<trace id>.<request id>`; each event's
//! id is the token, a dot and the event's number (1 for the first). SSE events carry it as
//! `id:`, which browsers send back as `Last-Event-ID` when they reconnect; an NDJSON caller
//! gets the token in the `Sluice-Resume-Token` header and sends `Sluice-Resume: <token>.<n>`
//! with the number of lines it has.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::{
    http::{HeaderMap, HeaderValue, StatusCode},
    response::Response,
};
use sluice_runtime::bus::Position;

use crate::Inner;

/// The request header an NDJSON (or any) caller resumes with: `<token>.<events received>`.
pub(crate) const RESUME_HEADER: &str = "sluice-resume";
/// The response header that gives a resumable stream's token.
pub(crate) const TOKEN_HEADER: &str = "sluice-resume-token";
/// What browsers send when an `EventSource` reconnects: the last event id received.
const LAST_EVENT_ID: &str = "last-event-id";

/// What a stream's events are rebuilt from, besides its records.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Token {
    /// The route that served the stream (a token is refused on another).
    pub route: String,
    /// A position on the response topic before the request's first record (`None`: the
    /// topic's oldest).
    pub after: Option<Position>,
    /// When the stream started, in Unix seconds (the OpenAI chunks' `created`; the age
    /// limit).
    pub created: u64,
    /// The trace id the stream's events carry (the event protocol's
    /// (docs/specs.md#the-event-protocol) `trace_id`), empty if none.
    pub trace_id: String,
    /// The request's correlation id.
    pub id: String,
}

impl Token {
    /// A new stream's token, started now.
    pub fn new(route: &str, id: &str, after: Option<Position>, trace_id: &str) -> Self {
        Self {
            route: route.to_owned(),
            after,
            created: now_secs(),
            trace_id: trace_id.to_owned(),
            id: id.to_owned(),
        }
    }

    /// The token as the headers and event ids carry it.
    pub fn encode(&self) -> String {
        let after = self.after.map_or_else(|| "-".to_owned(), |p| p.to_string());
        let trace = if self.trace_id.is_empty() {
            "-"
        } else {
            &self.trace_id
        };
        format!(
            "v1.{}.{after}.{}.{trace}.{}",
            self.route, self.created, self.id
        )
    }

    /// Reads what [`Token::encode`] wrote.
    pub fn decode(s: &str) -> Result<Self, String> {
        let bad = |why: &str| format!("not a resume token ({why})");
        let mut parts = s.splitn(6, '.');
        if parts.next() != Some("v1") {
            return Err(bad("it does not start with v1."));
        }
        let mut next = |what: &str| {
            parts
                .next()
                .filter(|p| !p.is_empty())
                .ok_or_else(|| bad(&format!("no {what}")))
        };
        let route = next("route")?.to_owned();
        let after = match next("position")? {
            "-" => None,
            p => Some(p.parse::<Position>().map_err(|e| bad(&e))?),
        };
        let created = next("start time")?
            .parse()
            .map_err(|_| bad("the start time is not a number"))?;
        let trace_id = match next("trace id")? {
            "-" => String::new(),
            t if t.bytes().all(|b| b.is_ascii_hexdigit()) => t.to_owned(),
            _ => return Err(bad("the trace id is not hexadecimal")),
        };
        let id = next("request id")?.to_owned();
        Ok(Self {
            route,
            after,
            created,
            trace_id,
            id,
        })
    }

    /// How long ago the stream started.
    pub fn age(&self) -> Duration {
        Duration::from_secs(now_secs().saturating_sub(self.created))
    }
}

/// A caller's request to resume: the stream, and how many of its events it has.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Resume {
    pub token: Token,
    pub received: u64,
}

impl Resume {
    /// Reads `<token>.<events received>`.
    fn parse(s: &str) -> Result<Self, String> {
        let (token, received) = s
            .rsplit_once('.')
            .ok_or_else(|| "not a resume token (<token>.<events received>)".to_owned())?;
        let received = received
            .parse()
            .map_err(|_| format!("{received:?} is not a number of events"))?;
        Ok(Self {
            token: Token::decode(token)?,
            received,
        })
    }
}

/// The resume a request asks for, from `Sluice-Resume` or else `Last-Event-ID`; `None` for a
/// new request. An id that is not one of ours (`Last-Event-ID` from another server's stream,
/// say) is an error: answering it as a new request would send the prompt to the provider
/// again.
pub(crate) fn asked(headers: &HeaderMap) -> Option<Result<Resume, String>> {
    let value = headers
        .get(RESUME_HEADER)
        .or_else(|| headers.get(LAST_EVENT_ID))?;
    Some(
        value
            .to_str()
            .map_err(|_| "the resume header is not ASCII".to_owned())
            .and_then(|v| Resume::parse(v.trim())),
    )
}

/// A refusal of a resume: its status, error kind and message.
pub(crate) type Refusal = (StatusCode, &'static str, String);

/// The resume a request on `route` asks for, if any, once it is known to be one this gateway
/// can serve: a token of this route, for a stream whose records can be read again
/// (`resumable`), not older than the gateway's resume window. Counted in
/// `sluice_gateway_resumes_total`.
pub(crate) fn checked(
    inner: &Inner,
    headers: &HeaderMap,
    route: &str,
    resumable: bool,
) -> Result<Option<Resume>, Refusal> {
    let Some(asked) = asked(headers) else {
        return Ok(None);
    };
    let verdict = asked
        .map_err(|e| {
            (
                StatusCode::BAD_REQUEST,
                "invalid-request",
                format!("cannot resume: {e}"),
            )
        })
        .and_then(|r| {
            if r.token.route != route {
                return Err((
                    StatusCode::BAD_REQUEST,
                    "invalid-request",
                    format!(
                        "cannot resume: the token is for a stream of the {} route, not {route}",
                        r.token.route
                    ),
                ));
            }
            if inner.config.resume_window.is_zero() {
                return Err((
                    StatusCode::CONFLICT,
                    "not-resumable",
                    "cannot resume: resuming streams is off on this gateway (--resume-window-secs 0)"
                        .to_owned(),
                ));
            }
            if !resumable {
                return Err((
                    StatusCode::CONFLICT,
                    "not-resumable",
                    format!(
                        "cannot resume: the {route} service's answers are not kept to be read again (the durable topic mapping on Pulsar keeps them)"
                    ),
                ));
            }
            let window = inner.config.resume_window;
            if r.token.age() > window {
                return Err((
                    StatusCode::GONE,
                    "resume-expired",
                    format!(
                        "cannot resume: the stream started {} s ago, and this gateway resumes streams up to {} s old (--resume-window-secs)",
                        r.token.age().as_secs(),
                        window.as_secs()
                    ),
                ));
            }
            Ok(r)
        });
    let outcome = match &verdict {
        Ok(_) => "resumed",
        Err((StatusCode::GONE, ..)) => "expired",
        Err(_) => "refused",
    };
    inner.metrics.resume(route, outcome);
    verdict.map(Some)
}

/// Whether a new stream of a service whose answers can be read again (`resumable`) gets a
/// token and event ids: unless resuming is off (`--resume-window-secs 0`, exact OpenAI
/// framing without `id:` lines).
pub(crate) fn offered(inner: &Inner, resumable: bool) -> bool {
    resumable && !inner.config.resume_window.is_zero()
}

/// Gives a resumable stream's token in the response's headers.
pub(crate) fn token_header(resp: &mut Response, token: Option<&str>) {
    if let Some(v) = token.and_then(|t| HeaderValue::from_str(t).ok()) {
        resp.headers_mut().insert(TOKEN_HEADER, v);
    }
}

/// What to do with the next event of a stream.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Step {
    /// The caller had it before it resumed: not sent again.
    Skip,
    /// Send it, with this id (`None`: the stream is not resumable).
    Send(Option<String>),
}

/// Numbers a stream's events and skips the ones a resuming caller had.
pub(crate) struct Numbering {
    token: Option<String>,
    next: u64,
    skip: u64,
}

impl Numbering {
    /// A stream that cannot be resumed: no ids.
    pub fn none() -> Self {
        Self {
            token: None,
            next: 1,
            skip: 0,
        }
    }

    /// A new resumable stream's numbering.
    pub fn new(token: &Token) -> Self {
        Self {
            token: Some(token.encode()),
            next: 1,
            skip: 0,
        }
    }

    /// A resumed stream's: the first `received` events are skipped.
    pub fn resumed(resume: &Resume) -> Self {
        Self {
            token: Some(resume.token.encode()),
            next: 1,
            skip: resume.received,
        }
    }

    /// The stream's token, when it can be resumed.
    pub fn token(&self) -> Option<&str> {
        self.token.as_deref()
    }

    /// The next event's fate.
    pub fn step(&mut self) -> Step {
        let n = self.next;
        self.next += 1;
        if n <= self.skip {
            return Step::Skip;
        }
        Step::Send(self.token.as_ref().map(|t| format!("{t}.{n}")))
    }
}

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn token() -> Token {
        Token {
            route: "text-completion".into(),
            after: Some(Position {
                ledger: 17,
                entry: 4,
                partition: -1,
                batch: -1,
            }),
            created: 1_764_300_000,
            trace_id: "4bf92f3577b34da6a3ce929d0e0e4736".into(),
            id: "6c1e2c38-5f57-4bd4-8a06-1a3f4a2a9f10".into(),
        }
    }

    #[test]
    fn a_token_reads_back_what_it_wrote() {
        let t = token();
        let s = t.encode();
        assert_eq!(
            s,
            "v1.text-completion.17:4:-1:-1.1764300000.4bf92f3577b34da6a3ce929d0e0e4736.6c1e2c38-5f57-4bd4-8a06-1a3f4a2a9f10"
        );
        assert_eq!(Token::decode(&s).unwrap(), t);
        // No position yet and no trace; a request id with dots of its own.
        let t = Token {
            after: None,
            trace_id: String::new(),
            id: "caller.chosen.id".into(),
            ..token()
        };
        assert_eq!(Token::decode(&t.encode()).unwrap(), t);
    }

    #[test]
    fn what_is_not_a_token_is_refused_saying_why() {
        for (s, why) in [
            ("", "v1"),
            ("v2.text-completion.-.1.-.id", "v1"),
            ("v1.text-completion", "no position"),
            ("v1.text-completion.1:2.1.-.id", "not a position"),
            ("v1.text-completion.-.soon.-.id", "start time"),
            ("v1.text-completion.-.1.<script>.id", "hexadecimal"),
            ("v1.text-completion.-.1.-", "no request id"),
        ] {
            let e = Token::decode(s).unwrap_err();
            assert!(e.contains(why), "{s:?}: {e}");
        }
    }

    #[test]
    fn the_resume_header_or_else_last_event_id_names_the_stream_and_the_events_received() {
        let t = token().encode();
        let mut h = HeaderMap::new();
        assert!(asked(&h).is_none());
        h.insert(LAST_EVENT_ID, format!("{t}.7").parse().unwrap());
        assert_eq!(
            asked(&h).unwrap().unwrap(),
            Resume {
                token: token(),
                received: 7
            }
        );
        h.insert(RESUME_HEADER, format!("{t}.3").parse().unwrap());
        assert_eq!(asked(&h).unwrap().unwrap().received, 3);
        h.insert(RESUME_HEADER, "chatcmpl-123".parse().unwrap());
        assert!(asked(&h).unwrap().is_err());
        h.insert(RESUME_HEADER, format!("{t}.x").parse().unwrap());
        assert!(asked(&h).unwrap().unwrap_err().contains("not a number"));
    }

    #[test]
    fn numbering_skips_what_the_caller_had_and_numbers_on() {
        let mut fresh = Numbering::new(&token());
        let t = token().encode();
        assert_eq!(fresh.step(), Step::Send(Some(format!("{t}.1"))));
        assert_eq!(fresh.step(), Step::Send(Some(format!("{t}.2"))));
        let mut resumed = Numbering::resumed(&Resume {
            token: token(),
            received: 2,
        });
        assert_eq!(resumed.step(), Step::Skip);
        assert_eq!(resumed.step(), Step::Skip);
        assert_eq!(resumed.step(), Step::Send(Some(format!("{t}.3"))));
        let mut none = Numbering::none();
        assert_eq!(none.step(), Step::Send(None));
    }
}
