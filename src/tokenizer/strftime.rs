//! `strftime_now(format)` for chat templates.
//!
//! transformers exposes `strftime_now` so templates can stamp today's date into
//! the system prompt (Llama 3.x writes "Today Date: 26 Jul 2024"). We format the
//! current UTC time ourselves rather than pull in a date crate: templates only
//! use a handful of directives, and UTC keeps the prompt independent of the
//! machine's time zone setting. Python would use local time.

use std::time::{SystemTime, UNIX_EPOCH};

const MONTH_NAMES: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const WEEKDAY_NAMES: [&str; 7] = [
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
    "Sunday",
];

/// A calendar date and time of day in UTC.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct UtcDateTime {
    pub year: i64,
    /// 1..=12
    pub month: u32,
    /// 1..=31
    pub day: u32,
    pub hour: u32,
    pub minute: u32,
    pub second: u32,
    /// 0 = Monday .. 6 = Sunday, as Python's `weekday()`.
    pub weekday: u32,
    /// 1..=366
    pub day_of_year: u32,
}

impl UtcDateTime {
    pub fn now() -> Self {
        let seconds = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|elapsed| elapsed.as_secs() as i64)
            // A clock set before 1970 is not worth failing a request over.
            .unwrap_or(0);
        Self::from_unix_seconds(seconds)
    }

    /// Converts with Howard Hinnant's days-to-civil algorithm (proleptic Gregorian).
    pub fn from_unix_seconds(seconds: i64) -> Self {
        let days = seconds.div_euclid(86_400);
        let second_of_day = seconds.rem_euclid(86_400) as u32;

        let shifted = days + 719_468;
        let era = shifted.div_euclid(146_097);
        let day_of_era = shifted.rem_euclid(146_097);
        let year_of_era =
            (day_of_era - day_of_era / 1460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
        let day_of_march_year =
            day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
        let month_index = (5 * day_of_march_year + 2) / 153;
        let day = (day_of_march_year - (153 * month_index + 2) / 5 + 1) as u32;
        let month = if month_index < 10 {
            month_index + 3
        } else {
            month_index - 9
        } as u32;
        let year = year_of_era + era * 400 + i64::from(month <= 2);

        // 1970-01-01 was a Thursday (weekday 3).
        let weekday = (days + 3).rem_euclid(7) as u32;
        let cumulative_days = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
        let is_leap = (year % 4 == 0 && year % 100 != 0) || year % 400 == 0;
        let leap_day = u32::from(is_leap && month > 2);
        let day_of_year = cumulative_days[(month - 1) as usize] + day + leap_day;

        UtcDateTime {
            year,
            month,
            day,
            hour: second_of_day / 3600,
            minute: second_of_day / 60 % 60,
            second: second_of_day % 60,
            weekday,
            day_of_year,
        }
    }

    /// Formats with the C `strftime` directives templates use. `%-d`-style
    /// directives (glibc's "no padding", which Python on Linux accepts) are
    /// supported for the numeric fields; an unknown directive is copied through.
    pub fn format(&self, format: &str) -> String {
        let month_name = MONTH_NAMES[(self.month - 1) as usize];
        let weekday_name = WEEKDAY_NAMES[self.weekday as usize];
        let hour12 = match self.hour % 12 {
            0 => 12,
            other => other,
        };

        let mut out = String::new();
        let mut chars = format.chars().peekable();
        while let Some(ch) = chars.next() {
            if ch != '%' {
                out.push(ch);
                continue;
            }
            let unpadded = chars.peek() == Some(&'-');
            if unpadded {
                chars.next();
            }
            let number = |value: i64, width: usize| {
                if unpadded {
                    value.to_string()
                } else {
                    format!("{value:0width$}")
                }
            };
            match chars.next() {
                Some('Y') => out.push_str(&self.year.to_string()),
                Some('y') => out.push_str(&number(self.year.rem_euclid(100), 2)),
                Some('m') => out.push_str(&number(self.month.into(), 2)),
                Some('d') => out.push_str(&number(self.day.into(), 2)),
                Some('e') => out.push_str(&format!("{:>2}", self.day)),
                Some('H') => out.push_str(&number(self.hour.into(), 2)),
                Some('I') => out.push_str(&number(hour12.into(), 2)),
                Some('M') => out.push_str(&number(self.minute.into(), 2)),
                Some('S') => out.push_str(&number(self.second.into(), 2)),
                Some('j') => out.push_str(&number(self.day_of_year.into(), 3)),
                Some('p') => out.push_str(if self.hour < 12 { "AM" } else { "PM" }),
                Some('B') => out.push_str(month_name),
                Some('b') | Some('h') => out.push_str(&month_name[..3]),
                Some('A') => out.push_str(weekday_name),
                Some('a') => out.push_str(&weekday_name[..3]),
                Some('F') => {
                    out.push_str(&format!("{}-{:02}-{:02}", self.year, self.month, self.day))
                }
                Some('%') => out.push('%'),
                Some(other) => {
                    out.push('%');
                    if unpadded {
                        out.push('-');
                    }
                    out.push(other);
                }
                None => out.push('%'),
            }
        }
        out
    }
}

/// The `strftime_now(format)` function registered in the chat template environment.
pub(crate) fn strftime_now(format: &str) -> String {
    UtcDateTime::now().format(format)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unix_seconds_become_the_right_calendar_date() {
        // 2024-07-26T13:25:09Z, a Friday, day 208 of a leap year.
        let date = UtcDateTime::from_unix_seconds(1_722_000_309);
        assert_eq!(
            date,
            UtcDateTime {
                year: 2024,
                month: 7,
                day: 26,
                hour: 13,
                minute: 25,
                second: 9,
                weekday: 4,
                day_of_year: 208
            }
        );
        assert_eq!(
            UtcDateTime::from_unix_seconds(0).format("%Y-%m-%d %A"),
            "1970-01-01 Thursday"
        );
        // The day before 2000-03-01 is the leap day of a year divisible by 400.
        assert_eq!(
            UtcDateTime::from_unix_seconds(951_782_400).format("%F %j"),
            "2000-02-29 060"
        );
    }

    #[test]
    fn formats_the_directives_templates_use() {
        let date = UtcDateTime::from_unix_seconds(1_722_000_309);
        assert_eq!(date.format("%d %b %Y"), "26 Jul 2024");
        assert_eq!(date.format("%B %-d, %Y"), "July 26, 2024");
        assert_eq!(date.format("%a %I:%M:%S %p %%"), "Fri 01:25:09 PM %");
        assert_eq!(date.format("%Q"), "%Q");
    }
}
