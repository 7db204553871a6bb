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
//! A stream's token is `v2.<route>.<position>.<created>.<trace id>.<seal>.<request id>`; each
//! event's id is the token, a dot and the event's number (1 for the first). SSE events carry
//! it as `id:`, which browsers send back as `Last-Event-ID` when they reconnect; an NDJSON
//! caller gets the token in the `Sluice-Resume-Token` header and sends
//! `Sluice-Resume: <token>.<n>` with the number of lines it has.
//!
//! The seal (see `sluice_runtime::seal`) is an HMAC of every other part of the token and of
//! the caller it was given to, under the secret the replicas share: a token cannot be made up
//! or edited (an earlier position would replay the shared response topic; an older start
//! time would stretch the window), and it resumes nothing for another caller (a leaked token
//! is no use to another API key). The window is judged by this gateway's clock, from the
//! sealed start time. A resumed stream is a reader: it is counted against its key's limits
//! like a request, and dropping it never cancels the request, which belongs to the caller
//! that sent it.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::{
    http::{HeaderMap, HeaderValue, StatusCode},
    response::Response,
};
use sluice_runtime::{
    bus::{NotAPosition, Position},
    seal::{Label, SealKey},
};

use crate::{Inner, auth::Caller};

/// What a token's seal is for (never the same as another seal's).
const TOKEN_SEAL: Label = Label::new("sluice/gateway/resume-token/v2");
/// The seal's length in a token, in bytes (128 bits, 22 characters).
const SEAL_BYTES: usize = 16;
/// How far ahead of this gateway's clock a token's start time may be: another replica's
/// clock may run ahead of this one's by a little, not by more.
const CLOCK_SKEW: Duration = Duration::from_secs(120);

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

    /// The parts of the token that are sealed, as they are written in it, and the caller's
    /// identity ([`Caller::identity`]).
    fn sealed_parts<'a>(
        &'a self,
        after: &'a str,
        created: &'a str,
        caller: &'a str,
    ) -> [&'a [u8]; 6] {
        [
            self.route.as_bytes(),
            after.as_bytes(),
            created.as_bytes(),
            self.trace_id.as_bytes(),
            self.id.as_bytes(),
            caller.as_bytes(),
        ]
    }

    /// The token as the headers and event ids carry it, sealed with `key` for `caller`.
    pub fn encode(&self, key: &SealKey, caller: &Caller) -> String {
        let after = self.after.map_or_else(|| "-".to_owned(), |p| p.to_string());
        let created = self.created.to_string();
        let identity = caller.identity();
        let seal = key
            .seal(TOKEN_SEAL, &self.sealed_parts(&after, &created, &identity))
            .encode(SEAL_BYTES);
        let trace = if self.trace_id.is_empty() {
            "-"
        } else {
            &self.trace_id
        };
        format!(
            "v2.{}.{after}.{created}.{trace}.{seal}.{}",
            self.route, self.id
        )
    }

    /// Whether `seal` is this token's for `caller` under `key`.
    fn sealed_for(&self, key: &SealKey, caller: &Caller, seal: &str) -> bool {
        let after = self.after.map_or_else(|| "-".to_owned(), |p| p.to_string());
        let created = self.created.to_string();
        let identity = caller.identity();
        key.verify_encoded(
            TOKEN_SEAL,
            &self.sealed_parts(&after, &created, &identity),
            seal,
        )
    }

    /// Reads what [`Token::encode`] wrote: the token and its seal, not yet verified.
    pub fn decode(s: &str) -> Result<(Self, String), TokenError> {
        let mut parts = s.splitn(7, '.');
        match parts.next() {
            Some("v2") => {}
            Some("v1") => return Err(TokenError::Outdated),
            _ => return Err(TokenError::NotV2),
        }
        let mut next = |what: &'static str| {
            parts
                .next()
                .filter(|p| !p.is_empty())
                .ok_or(TokenError::Missing(what))
        };
        let route = next("route")?.to_owned();
        let after = match next("position")? {
            "-" => None,
            p => Some(p.parse::<Position>().map_err(TokenError::Position)?),
        };
        let created = next("start time")?
            .parse()
            .map_err(|_| TokenError::StartTime)?;
        let trace_id = match next("trace id")? {
            "-" => String::new(),
            t if t.bytes().all(|b| b.is_ascii_hexdigit()) => t.to_owned(),
            _ => return Err(TokenError::TraceId),
        };
        let seal = next("seal")?.to_owned();
        let id = next("request id")?.to_owned();
        Ok((
            Self {
                route,
                after,
                created,
                trace_id,
                id,
            },
            seal,
        ))
    }

    /// How long ago the stream started, by this gateway's clock.
    pub fn age(&self) -> Duration {
        Duration::from_secs(now_secs().saturating_sub(self.created))
    }

    /// Whether the stream starts after this gateway's clock's now and a little skew.
    fn starts_in_the_future(&self) -> bool {
        self.created > now_secs().saturating_add(CLOCK_SKEW.as_secs())
    }
}

/// A caller's request to resume: the stream, and how many of its events it has.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Resume {
    pub token: Token,
    /// The token as the caller sent it (its events' ids go on with it).
    pub sent: String,
    /// The token's seal, as sent.
    seal: String,
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
        let (decoded, seal) = Token::decode(token).map_err(|e| e.to_string())?;
        Ok(Self {
            token: decoded,
            sent: token.to_owned(),
            seal,
            received,
        })
    }
}

/// Why a resume token cannot be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TokenError {
    /// A token of the earlier format, which the gateway no longer accepts.
    #[error(
        "the token was issued by an earlier version of the gateway, whose tokens are no longer accepted: send the request again"
    )]
    Outdated,
    /// It does not start with this format's version.
    #[error("not a resume token (it does not start with v2.)")]
    NotV2,
    /// A part is missing or empty (which).
    #[error("not a resume token (no {0})")]
    Missing(&'static str),
    /// The position part is not a position.
    #[error("not a resume token ({0})")]
    Position(NotAPosition),
    /// The start time is not a number.
    #[error("not a resume token (the start time is not a number)")]
    StartTime,
    /// The trace id is not hexadecimal.
    #[error("not a resume token (the trace id is not hexadecimal)")]
    TraceId,
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

/// Reads `value` as a `Sluice-Resume` header, as a request's is read, and a token read so is
/// checked against its own seal and then sealed anew and read back (for the fuzz target,
/// `fuzz/src/bin/shared.rs`): `None` for a value that is not a resume; else whether the
/// token read back is the one read and its new seal verifies.
pub(crate) fn round_trip(value: &[u8], key: &SealKey) -> Option<bool> {
    let mut headers = HeaderMap::new();
    headers.insert(RESUME_HEADER, HeaderValue::from_bytes(value).ok()?);
    let resume = asked(&headers)?.ok()?;
    // The seal as sent is any text: verifying it must neither fail nor pass by accident.
    if resume.token.sealed_for(key, &Caller::Anyone, &resume.seal) {
        return Some(false);
    }
    let encoded = resume.token.encode(key, &Caller::Anyone);
    let Ok((again, seal)) = Token::decode(&encoded) else {
        return Some(false);
    };
    Some(again == resume.token && again.sealed_for(key, &Caller::Anyone, &seal))
}

/// A refusal of a resume: its status, error kind and message.
pub(crate) type Refusal = (StatusCode, &'static str, String);

/// Why a resume was refused (`sluice_gateway_resume_refusals_total{reason}`).
pub(crate) const REFUSAL_REASONS: [&str; 7] = [
    "malformed",
    "route",
    "off",
    "not-resumable",
    "seal",
    "expired",
    "future",
];

/// The resume a request of `caller` on `route` asks for, if any, once it is known to be one
/// this gateway can serve: a token of this route, sealed by these gateways for this caller,
/// for a stream whose records can be read again (`resumable`), started within the gateway's
/// resume window by its own clock. Counted in `sluice_gateway_resumes_total`, refusals also
/// in `sluice_gateway_resume_refusals_total` by reason. Admitting it against the caller's
/// limits is [`Inner::admit_resume`]'s.
pub(crate) fn checked(
    inner: &Inner,
    headers: &HeaderMap,
    route: &str,
    resumable: bool,
    caller: &Caller,
) -> Result<Option<Resume>, Refusal> {
    let Some(asked) = asked(headers) else {
        return Ok(None);
    };
    let verdict = asked
        .map_err(|e| {
            (
                "malformed",
                (
                    StatusCode::BAD_REQUEST,
                    "invalid-request",
                    format!("cannot resume: {e}"),
                ),
            )
        })
        .and_then(|r| judge(inner, route, resumable, caller, r));
    let outcome = match &verdict {
        Ok(_) => "resumed",
        Err((_, (StatusCode::GONE, ..))) => "expired",
        Err(_) => "refused",
    };
    inner.metrics.resume(route, outcome);
    match verdict {
        Ok(r) => Ok(Some(r)),
        Err((reason, refusal)) => {
            inner.metrics.resume_refused(reason);
            Err(refusal)
        }
    }
}

/// [`checked`]'s rules for a token that reads as one, with the reason of a refusal.
fn judge(
    inner: &Inner,
    route: &str,
    resumable: bool,
    caller: &Caller,
    r: Resume,
) -> Result<Resume, (&'static str, Refusal)> {
    if r.token.route != route {
        return Err((
            "route",
            (
                StatusCode::BAD_REQUEST,
                "invalid-request",
                format!(
                    "cannot resume: the token is for a stream of the {} route, not {route}",
                    r.token.route
                ),
            ),
        ));
    }
    if inner.config.resume_window.is_zero() {
        return Err((
            "off",
            (
                StatusCode::CONFLICT,
                "not-resumable",
                "cannot resume: resuming streams is off on this gateway (--resume-window-secs 0)"
                    .to_owned(),
            ),
        ));
    }
    if !resumable {
        return Err((
            "not-resumable",
            (
                StatusCode::CONFLICT,
                "not-resumable",
                format!(
                    "cannot resume: the {route} service's answers are not kept to be read again (the durable topic mapping on Pulsar keeps them)"
                ),
            ),
        ));
    }
    if !r.token.sealed_for(&inner.seal, caller, &r.seal) {
        // Which it is (another caller's token, an edited one, another secret's) is not told:
        // each would help someone trying tokens.
        let message = if inner.seal.is_shared() {
            "cannot resume: the token was not given to this caller by this gateway's replicas, or it was altered"
        } else {
            "cannot resume: the token was not given to this caller by this gateway, or it was altered (gateway replicas resume each other's streams only when they share a secret: SLUICE_GATEWAY_SECRET)"
        };
        return Err((
            "seal",
            (StatusCode::FORBIDDEN, "resume-refused", message.to_owned()),
        ));
    }
    if r.token.starts_in_the_future() {
        return Err((
            "future",
            (
                StatusCode::BAD_REQUEST,
                "invalid-request",
                "cannot resume: the stream's start time is ahead of this gateway's clock (the replicas' clocks disagree)"
                    .to_owned(),
            ),
        ));
    }
    let window = inner.config.resume_window;
    if r.token.age() > window {
        return Err((
            "expired",
            (
                StatusCode::GONE,
                "resume-expired",
                format!(
                    "cannot resume: the stream started {} s ago, and this gateway resumes streams up to {} s old (--resume-window-secs)",
                    r.token.age().as_secs(),
                    window.as_secs()
                ),
            ),
        ));
    }
    Ok(r)
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

    /// A new resumable stream's numbering: `token`, sealed for `caller`.
    pub fn new(inner: &Inner, caller: &Caller, token: &Token) -> Self {
        Self::sealed(&inner.seal, caller, token)
    }

    fn sealed(key: &SealKey, caller: &Caller, token: &Token) -> Self {
        Self {
            token: Some(token.encode(key, caller)),
            next: 1,
            skip: 0,
        }
    }

    /// A resumed stream's: the same token, and the first `received` events are skipped.
    pub fn resumed(resume: &Resume) -> Self {
        Self {
            token: Some(resume.sent.clone()),
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
    use std::sync::Arc;

    use sluice_runtime::{bus::memory::MemoryBus, secret::Secret, telemetry::Telemetry};

    use super::*;
    use crate::keys::{KeyRing, hash_hex};

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

    const SECRET: &str = "0123456789abcdef0123456789abcdef";

    fn shared() -> SealKey {
        SealKey::new(&Secret::new(SECRET), "test").unwrap()
    }

    /// The fuzz target's property holds where it is known: a token the gateway gave, sent
    /// back in `Sluice-Resume`, reads back as itself once sealed anew, and its own seal (made
    /// for the caller `Anyone`) is not mistaken for that; what is no resume is `None`.
    #[test]
    fn the_fuzz_round_trip_reads_a_genuine_token_back_and_no_other_text() {
        let other =
            SealKey::new(&Secret::new("another-secret-0123456789abcdefgh"), "test").unwrap();
        let sent = format!("{}.3", token().encode(&other, &key("a")));
        assert_eq!(round_trip(sent.as_bytes(), &shared()), Some(true));
        let without = Token {
            after: None,
            trace_id: String::new(),
            ..token()
        };
        let sent = format!("{}.0", without.encode(&other, &Caller::Anyone));
        assert_eq!(round_trip(sent.as_bytes(), &shared()), Some(true));
        // Sealed with the key it is checked with, for the caller it is checked for: the
        // seal sent verifies, which the target reports.
        let own = format!("{}.0", without.encode(&shared(), &Caller::Anyone));
        assert_eq!(round_trip(own.as_bytes(), &shared()), Some(false));
        for junk in [
            "",
            "v2",
            "v2.a.b.c",
            "v1.x.y.1.2",
            "\u{7f}",
            "v2.tc.-.1.-.s.id",
        ] {
            assert_eq!(round_trip(junk.as_bytes(), &shared()), None, "{junk:?}");
        }
    }

    /// The callers of a keys file with the keys `a` and `b`.
    fn key(name: &str) -> Caller {
        let text: String = ["a", "b"]
            .iter()
            .map(|n| format!("[[keys]]\nname = \"{n}\"\nsha256 = \"{}\"\n", hash_hex(n)))
            .collect();
        Caller::Key(KeyRing::parse(&text).unwrap().find(name).unwrap())
    }

    #[test]
    fn a_token_reads_back_what_it_wrote_and_its_seal_is_the_callers() {
        let t = token();
        let s = t.encode(&shared(), &key("a"));
        let (head, rest) = s.split_at(s.rfind('.').unwrap() - 22);
        assert_eq!(
            head,
            "v2.text-completion.17:4:-1:-1.1764300000.4bf92f3577b34da6a3ce929d0e0e4736."
        );
        assert!(
            rest.ends_with(".6c1e2c38-5f57-4bd4-8a06-1a3f4a2a9f10"),
            "{rest}"
        );
        let (read, seal) = Token::decode(&s).unwrap();
        assert_eq!(read, t);
        assert!(read.sealed_for(&shared(), &key("a"), &seal));
        // No position yet and no trace; a request id with dots of its own.
        let t = Token {
            after: None,
            trace_id: String::new(),
            id: "caller.chosen.id".into(),
            ..token()
        };
        let (read, seal) = Token::decode(&t.encode(&shared(), &Caller::Anyone)).unwrap();
        assert_eq!(read, t);
        assert!(read.sealed_for(&shared(), &Caller::Anyone, &seal));
    }

    #[test]
    fn a_token_is_good_only_for_its_caller_as_it_was_sealed_by_the_same_secret() {
        let (t, seal) = Token::decode(&token().encode(&shared(), &key("a"))).unwrap();
        assert!(t.sealed_for(&shared(), &key("a"), &seal));
        // Another key, the gateway's token, anyone.
        for other in [key("b"), Caller::Token, Caller::Anyone] {
            assert!(!t.sealed_for(&shared(), &other, &seal), "{other:?}");
        }
        // Another gateway's secret (a replica without the shared one).
        assert!(!t.sealed_for(&SealKey::random(), &key("a"), &seal));
        // Every part edited: an older start (a longer window), an earlier position (the
        // topic replayed from its start), another request, route or trace.
        let edits: [fn(&mut Token); 6] = [
            |t| t.created -= 3600,
            |t| t.created += 1,
            |t| t.after = None,
            |t| t.id = "another".into(),
            |t| t.route = "openai-chat".into(),
            |t| t.trace_id = "00".into(),
        ];
        for edit in edits {
            let mut edited = t.clone();
            edit(&mut edited);
            assert!(
                !edited.sealed_for(&shared(), &key("a"), &seal),
                "{edited:?}"
            );
        }
        // A seal cut short, or another token's.
        assert!(!t.sealed_for(&shared(), &key("a"), &seal[..20]));
        let (_, other) = Token::decode(
            &Token {
                id: "another".into(),
                ..token()
            }
            .encode(&shared(), &key("a")),
        )
        .unwrap();
        assert!(!t.sealed_for(&shared(), &key("a"), &other));
    }

    #[test]
    fn what_is_not_a_token_is_refused_saying_why() {
        for (s, why) in [
            ("", "v2"),
            ("v3.text-completion.-.1.-.seal.id", "v2"),
            ("v1.text-completion.-.1.-.id", "earlier version"),
            ("v2.text-completion", "no position"),
            ("v2.text-completion.1:2.1.-.seal.id", "not a position"),
            ("v2.text-completion.-.soon.-.seal.id", "start time"),
            ("v2.text-completion.-.1.<script>.seal.id", "hexadecimal"),
            ("v2.text-completion.-.1.-.seal", "no request id"),
            ("v2.text-completion.-.1.-", "no seal"),
        ] {
            let e = Token::decode(s).unwrap_err().to_string();
            assert!(e.contains(why), "{s:?}: {e}");
        }
    }

    #[test]
    fn the_resume_header_or_else_last_event_id_names_the_stream_and_the_events_received() {
        let t = token().encode(&shared(), &key("a"));
        let mut h = HeaderMap::new();
        assert!(asked(&h).is_none());
        h.insert(LAST_EVENT_ID, format!("{t}.7").parse().unwrap());
        let r = asked(&h).unwrap().unwrap();
        assert_eq!(
            (&r.token, r.received, r.sent.as_str()),
            (&token(), 7, t.as_str())
        );
        h.insert(RESUME_HEADER, format!("{t}.3").parse().unwrap());
        assert_eq!(asked(&h).unwrap().unwrap().received, 3);
        h.insert(RESUME_HEADER, "chatcmpl-123".parse().unwrap());
        assert!(asked(&h).unwrap().is_err());
        h.insert(RESUME_HEADER, format!("{t}.x").parse().unwrap());
        assert!(asked(&h).unwrap().unwrap_err().contains("not a number"));
    }

    #[test]
    fn numbering_skips_what_the_caller_had_and_numbers_on_with_the_same_token() {
        let mut fresh = Numbering::sealed(&shared(), &key("a"), &token());
        let t = token().encode(&shared(), &key("a"));
        assert_eq!(fresh.step(), Step::Send(Some(format!("{t}.1"))));
        assert_eq!(fresh.step(), Step::Send(Some(format!("{t}.2"))));
        let mut h = HeaderMap::new();
        h.insert(RESUME_HEADER, format!("{t}.2").parse().unwrap());
        let mut resumed = Numbering::resumed(&asked(&h).unwrap().unwrap());
        assert_eq!(resumed.step(), Step::Skip);
        assert_eq!(resumed.step(), Step::Skip);
        assert_eq!(resumed.step(), Step::Send(Some(format!("{t}.3"))));
        let mut none = Numbering::none();
        assert_eq!(none.step(), Step::Send(None));
    }

    /// A gateway on the in-process bus (its answers are not kept: `checked` is told they
    /// are) with `secret`, resuming streams up to a minute old.
    async fn gateway(secret: Option<SealKey>) -> crate::Gateway {
        let mut config = crate::tests::serving_text_completion();
        config.secret = secret;
        config.resume_window = Duration::from_secs(60);
        let bus: Arc<dyn sluice_runtime::bus::Bus> = Arc::new(MemoryBus::new(1 << 20, 100));
        crate::Gateway::start(bus, config, &Telemetry::new().unwrap())
            .await
            .unwrap()
    }

    fn resume_header(token: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(RESUME_HEADER, format!("{token}.1").parse().unwrap());
        h
    }

    #[tokio::test]
    async fn a_resume_is_refused_for_another_caller_and_outside_the_window_by_this_clock() {
        let g = gateway(Some(shared())).await;
        let inner = &g.inner;
        let started = |ago: i64| Token {
            created: (now_secs() as i64 - ago) as u64,
            ..token()
        };
        let check = |t: &Token, sealed_for: &Caller, caller: &Caller| {
            let h = resume_header(&t.encode(&shared(), sealed_for));
            checked(inner, &h, "text-completion", true, caller)
        };
        let a = key("a");
        assert!(check(&started(5), &a, &a).unwrap().is_some());
        let (status, kind, message) = check(&started(5), &a, &key("b")).unwrap_err();
        assert_eq!((status, kind), (StatusCode::FORBIDDEN, "resume-refused"));
        assert!(message.contains("not given to this caller"), "{message}");
        // The window, by this gateway's clock from the sealed start time.
        let (status, _, message) = check(&started(61), &a, &a).unwrap_err();
        assert_eq!(status, StatusCode::GONE);
        assert!(message.contains("up to 60 s old"), "{message}");
        let (status, _, message) = check(&started(-3600), &a, &a).unwrap_err();
        assert_eq!(status, StatusCode::BAD_REQUEST);
        assert!(
            message.contains("ahead of this gateway's clock"),
            "{message}"
        );
        // Another route's token, resumed on this one.
        let chat = Token {
            route: "openai-chat".into(),
            ..started(5)
        };
        let (status, _, message) = check(&chat, &a, &a).unwrap_err();
        assert_eq!(status, StatusCode::BAD_REQUEST);
        assert!(message.contains("openai-chat route"), "{message}");
        let m = &inner.metrics;
        for (reason, n) in [("seal", 1), ("expired", 1), ("future", 1), ("route", 1)] {
            assert_eq!(m.resume_refusals(reason), n, "{reason}");
        }
        g.close().await;
    }

    #[tokio::test]
    async fn without_a_shared_secret_a_token_of_another_gateway_is_refused_saying_why() {
        let (one, two) = (gateway(None).await, gateway(None).await);
        let t = Token {
            created: now_secs(),
            ..token()
        };
        let h = resume_header(&t.encode(&one.inner.seal, &Caller::Anyone));
        assert!(
            checked(&one.inner, &h, "text-completion", true, &Caller::Anyone)
                .unwrap()
                .is_some()
        );
        let (status, _, message) =
            checked(&two.inner, &h, "text-completion", true, &Caller::Anyone).unwrap_err();
        assert_eq!(status, StatusCode::FORBIDDEN);
        assert!(message.contains("SLUICE_GATEWAY_SECRET"), "{message}");
        // Replicas given one secret resume each other's.
        let (three, four) = (gateway(Some(shared())).await, gateway(Some(shared())).await);
        let h = resume_header(&t.encode(&three.inner.seal, &Caller::Token));
        assert!(
            checked(&four.inner, &h, "text-completion", true, &Caller::Token)
                .unwrap()
                .is_some()
        );
        for g in [one, two, three, four] {
            g.close().await;
        }
    }
}
