//! Exponential backoff with full jitter: how sluice waits for a broker, its admin API or a
//! store probe that does not answer yet.

use std::time::Duration;

/// Exponential backoff with full jitter, from 50 ms up to a cap: how sluice waits for a broker
/// (or its admin API) that does not answer yet.
pub struct Backoff {
    next: Duration,
    max: Duration,
}

impl Backoff {
    /// Starts at 50 ms; the bound doubles after each delay, up to `max`.
    pub fn new(max: Duration) -> Self {
        Self {
            next: Duration::from_millis(50),
            max,
        }
    }

    /// The upper bound of the next delay.
    pub fn peek(&self) -> Duration {
        self.next
    }

    /// The next delay, jittered between half the bound and the bound, which then doubles.
    pub fn next_delay(&mut self) -> Duration {
        let bound = self.next;
        self.next = (self.next * 2).min(self.max);
        // Full jitter keeps a fleet of replicas from reconnecting in lockstep.
        let millis = u64::try_from(bound.as_millis()).unwrap_or(u64::MAX);
        Duration::from_millis(rand::random_range(millis / 2..=millis.max(1)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_grows_to_its_cap_with_jitter() {
        let mut b = Backoff::new(Duration::from_millis(400));
        let delays: Vec<_> = (0..6).map(|_| b.next_delay()).collect();
        assert!(delays[0] >= Duration::from_millis(25) && delays[0] <= Duration::from_millis(50));
        assert!(delays.iter().all(|d| *d <= Duration::from_millis(400)));
        assert_eq!(b.peek(), Duration::from_millis(400));
    }
}
