//! The wall clock, cut into the minutes, UTC days and UTC months limits are counted in.

use std::time::{SystemTime, UNIX_EPOCH};

/// The wall clock, cut into the windows limits are counted in.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Now {
    /// Seconds since the Unix epoch.
    pub(super) secs: f64,
    pub(super) minute: u64,
    pub(super) day: u64,
    /// Months since January 1970.
    pub(super) month: u64,
}

impl Now {
    pub(super) fn at(secs: f64) -> Self {
        let whole = secs.max(0.0) as u64;
        let day = whole / 86_400;
        let (y, m) = civil_month(day);
        Self {
            secs,
            minute: whole / 60,
            day,
            month: (y - 1970) * 12 + (m - 1),
        }
    }

    pub(super) fn wall() -> Self {
        Self::at(
            SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0.0, |d| d.as_secs_f64()),
        )
    }

    /// Microseconds since the Unix epoch.
    pub(super) fn micros(&self) -> u64 {
        (self.secs.max(0.0) * 1_000_000.0) as u64
    }

    /// How far into the minute, 0 to 1.
    pub(super) fn minute_fraction(&self) -> f64 {
        (self.secs / 60.0).fract()
    }

    pub(super) fn secs_to_next_day(&self) -> f64 {
        ((self.day + 1) * 86_400) as f64 - self.secs
    }

    pub(super) fn secs_to_next_month(&self) -> f64 {
        let (y, m) = (1970 + self.month / 12, self.month % 12 + 1);
        let (y, m) = if m == 12 { (y + 1, 1) } else { (y, m + 1) };
        (days_from_civil(y, m, 1) * 86_400) as f64 - self.secs
    }
}

/// The year and month (1-12) of a day since the epoch.
pub(super) fn civil_month(days: u64) -> (u64, u64) {
    let (y, m, _) = civil_from_days(days);
    (y, m)
}

/// The proleptic Gregorian date (year, month 1-12, day 1-31) `days` after 1970-01-01 (Howard
/// Hinnant's `civil_from_days`, for days since the epoch, so never negative here).
pub(crate) fn civil_from_days(days: u64) -> (u64, u64, u64) {
    let z = days + 719_468;
    let era = z / 146_097;
    let doe = z % 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + u64::from(month <= 2);
    (year, month, day)
}

/// Days since the epoch of a date (the inverse of [`civil_month`]'s computation).
pub(super) fn days_from_civil(y: u64, m: u64, d: u64) -> u64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y / 400;
    let yoe = y - era * 400;
    let mp = if m > 2 { m - 3 } else { m + 9 };
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}
