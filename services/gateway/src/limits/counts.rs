//! One replica's counts of one key, as a snapshot carries them.

use super::*;

/// One replica's counts for one key: the current and the previous minute (a sliding minute
/// weighs the previous one by how much of it still falls in the last 60 s), the day, the
/// month. What a snapshot carries.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Counts {
    pub(super) minute: u64,
    pub(super) requests: u64,
    pub(super) tokens: u64,
    pub(super) prev_requests: u64,
    pub(super) prev_tokens: u64,
    pub(super) day: u64,
    pub(super) day_tokens: u64,
    pub(super) month: u64,
    pub(super) month_tokens: u64,
    /// Requests admitted and not yet ended (resumed streams included).
    #[serde(default)]
    pub(super) in_flight: u64,
}

impl Counts {
    /// These counts as they stand at `now`: windows that have passed are emptied.
    pub(super) fn at(self, now: &Now) -> Self {
        let (requests, tokens, prev_requests, prev_tokens) = if self.minute == now.minute {
            (
                self.requests,
                self.tokens,
                self.prev_requests,
                self.prev_tokens,
            )
        } else if self.minute.saturating_add(1) == now.minute {
            (0, 0, self.requests, self.tokens)
        } else if self.minute == now.minute.saturating_add(1) {
            // A replica whose clock runs ahead into the next minute: all it counted is recent.
            (
                self.requests.saturating_add(self.prev_requests),
                self.tokens.saturating_add(self.prev_tokens),
                0,
                0,
            )
        } else {
            (0, 0, 0, 0)
        };
        Self {
            minute: now.minute,
            requests,
            tokens,
            prev_requests,
            prev_tokens,
            day: now.day,
            day_tokens: if self.day == now.day {
                self.day_tokens
            } else {
                0
            },
            month: now.month,
            month_tokens: if self.month == now.month {
                self.month_tokens
            } else {
                0
            },
            in_flight: self.in_flight,
        }
    }

    /// Whether these counts were published within the last two minutes (by the publisher's
    /// clock): what their requests in flight are believed for.
    pub(super) fn fresh(&self, now: &Now) -> bool {
        self.minute.saturating_add(1) >= now.minute
    }

    pub(super) fn add(&mut self, other: &Counts) {
        self.requests = self.requests.saturating_add(other.requests);
        self.tokens = self.tokens.saturating_add(other.tokens);
        self.prev_requests = self.prev_requests.saturating_add(other.prev_requests);
        self.prev_tokens = self.prev_tokens.saturating_add(other.prev_tokens);
        self.day_tokens = self.day_tokens.saturating_add(other.day_tokens);
        self.month_tokens = self.month_tokens.saturating_add(other.month_tokens);
        self.in_flight = self.in_flight.saturating_add(other.in_flight);
    }

    /// Whether a snapshot of these counts is worth keeping on the topic.
    pub(super) fn holds_usage(&self) -> bool {
        self.day_tokens > 0 || self.month_tokens > 0 || self.requests > 0 || self.in_flight > 0
    }
}
