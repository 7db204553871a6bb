//! What the fuzz targets share: how an input is cut into chunks (split-invariance checks
//! feed the same bytes whole and in pieces) and a Tokio runtime for the stream decoders.
//!
//! Every target reads its input as `[selector, split, body...]`: `selector` picks a decoder
//! where a target has several, `split` seeds the chunk lengths (0 = one chunk), `body` is
//! what the decoder reads. The seed corpora under `corpus/` are written that way.

use std::cell::RefCell;

use futures::StreamExt;
use sluice_text_completion::{
    provider::{Chunk, ChunkStream, FailureKind},
    providers::{Body, HttpTimeouts},
};

/// An input cut into its header bytes and body.
pub struct Input<'a> {
    /// Picks the decoder.
    pub selector: u8,
    /// Seeds the chunking.
    pub split: u8,
    /// The bytes to decode.
    pub body: &'a [u8],
}

impl<'a> Input<'a> {
    /// `None` for inputs shorter than the two header bytes.
    pub fn new(data: &'a [u8]) -> Option<Self> {
        match data {
            [selector, split, body @ ..] => Some(Self {
                selector: *selector,
                split: *split,
                body,
            }),
            _ => None,
        }
    }
}

/// Cuts `body` into chunks whose lengths come from a small xorshift seeded by `split`
/// (1 to `split % 16 + 1` bytes each); `split == 0` gives the body as one chunk.
pub fn chunks(body: &[u8], split: u8) -> Vec<&[u8]> {
    if split == 0 || body.is_empty() {
        return vec![body];
    }
    let max = usize::from(split % 16) + 1;
    let mut state = u32::from(split) | 0x9e37_7900;
    let mut out = Vec::new();
    let mut rest = body;
    while !rest.is_empty() {
        state ^= state << 13;
        state ^= state >> 17;
        state ^= state << 5;
        let n = (state as usize % max + 1).min(rest.len());
        let (head, tail) = rest.split_at(n);
        out.push(head);
        rest = tail;
    }
    out
}

/// [`chunks`] of a text, each cut moved forward to a character boundary (text deltas are
/// `&str`, so they never split a character).
pub fn text_chunks(text: &str, split: u8) -> Vec<&str> {
    let mut out = Vec::new();
    let (mut at, mut cut) = (0, 0);
    for piece in chunks(text.as_bytes(), split) {
        cut += piece.len();
        let mut end = cut;
        while !text.is_char_boundary(end) {
            end += 1;
        }
        if end > at {
            out.push(&text[at..end]);
            at = end;
        }
    }
    if out.is_empty() {
        out.push("");
    }
    out
}

thread_local! {
    static RUNTIME: RefCell<Option<tokio::runtime::Runtime>> = const { RefCell::new(None) };
}

/// Runs `f` to completion on a current-thread runtime with the time driver (the
/// providers' stream decoders carry first-token and between-chunk timeouts). The runtime is
/// built on first use, inside the forked child AFL runs.
pub fn block_on<F: std::future::Future>(f: F) -> F::Output {
    RUNTIME.with(|cell| {
        let mut slot = cell.borrow_mut();
        let rt = slot.get_or_insert_with(|| {
            tokio::runtime::Builder::new_current_thread()
                .enable_time()
                .build()
                .unwrap_or_else(|e| panic!("tokio runtime: {e}"))
        });
        rt.block_on(f)
    })
}

/// What a provider stream decoder made of a body: its chunks, and its error as kind and
/// message.
pub type Decoded = Vec<Result<Chunk, (FailureKind, String)>>;

/// Runs a provider's `decode_stream` over `pieces`, each one read of the body.
pub fn decode_chunks(decode: fn(Body, HttpTimeouts) -> ChunkStream, pieces: &[&[u8]]) -> Decoded {
    let body = futures::stream::iter(
        pieces
            .iter()
            .map(|p| Ok::<_, reqwest::Error>(bytes::Bytes::copy_from_slice(p)))
            .collect::<Vec<_>>(),
    )
    .boxed();
    block_on(
        decode(body, HttpTimeouts::default())
            .map(|r| r.map_err(|e| (e.kind, e.message)))
            .collect(),
    )
}

/// The properties every provider stream decoder keeps: `body` decoded whole and read as
/// `pieces` gives the same chunks and error, and the chunks' text is never longer than the
/// body. Panics (a finding) when one does not hold.
pub fn check_stream_decoder(
    decode: fn(Body, HttpTimeouts) -> ChunkStream,
    body: &[u8],
    pieces: &[&[u8]],
) {
    let whole = decode_chunks(decode, &[body]);
    let split = decode_chunks(decode, pieces);
    assert_eq!(whole, split, "the split changed what was decoded");
    let text: usize = whole
        .iter()
        .filter_map(|c| c.as_ref().ok())
        .map(|c| c.text.len())
        .sum();
    assert!(text <= body.len(), "more text than body");
}
