//! Times on the wire: RFC 3339 in UTC, from and to Unix milliseconds. The
//! one copy, shared by the server, the control plane and the CLI.

/// Milliseconds since the Unix epoch, now.
pub fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}

/// `YYYY-MM-DDTHH:MM:SS.mmmZ`.
pub fn rfc3339(ms: i64) -> String {
    let (date, tod) = split(ms);
    format!("{date}T{:02}:{:02}:{:02}.{:03}Z", tod / 3600, tod / 60 % 60, tod % 60, ms.rem_euclid(1000))
}

/// `YYYY-MM-DDTHH:MM:SSZ`, to the second (for people).
pub fn rfc3339_seconds(ms: i64) -> String {
    let (date, tod) = split(ms);
    format!("{date}T{:02}:{:02}:{:02}Z", tod / 3600, tod / 60 % 60, tod % 60)
}

/// The date part and the second of the day.
fn split(ms: i64) -> (String, i64) {
    let secs = ms.div_euclid(1000);
    let (y, m, d) = civil_from_days(secs.div_euclid(86_400));
    (format!("{y:04}-{m:02}-{d:02}"), secs.rem_euclid(86_400))
}

/// RFC 3339 (`Z` or `±HH:MM`, an optional fraction) to Unix milliseconds;
/// `None` when it is not one, or when it falls outside years 0000 to 9999
/// in UTC.
pub fn parse_rfc3339(s: &str) -> Option<i64> {
    let b = s.as_bytes();
    if b.len() < 20 || b[4] != b'-' || b[7] != b'-' || !matches!(b[10], b'T' | b't') {
        return None;
    }
    if b[13] != b':' || b[16] != b':' {
        return None;
    }
    let num = |r: std::ops::Range<usize>| -> Option<i64> {
        let t = s.get(r)?;
        if t.bytes().all(|c| c.is_ascii_digit()) {
            t.parse().ok()
        } else {
            None
        }
    };
    let (y, mo, d, h, mi, sec) = (num(0..4)?, num(5..7)?, num(8..10)?, num(11..13)?, num(14..16)?, num(17..19)?);
    if !(1..=12).contains(&mo) || !(1..=31).contains(&d) || h > 23 || mi > 59 || sec > 60 {
        return None;
    }
    let mut i = 19;
    let mut frac_ms = 0i64;
    if b.get(i) == Some(&b'.') {
        i += 1;
        let start = i;
        while b.get(i).is_some_and(u8::is_ascii_digit) {
            i += 1;
        }
        if i == start || i - start > 9 {
            return None;
        }
        let digits = s.get(start..i.min(start + 3))?;
        frac_ms = digits.parse::<i64>().ok()? * 10i64.pow(3 - digits.len() as u32);
    }
    let offset_secs = match s.get(i..)? {
        "Z" | "z" => 0,
        tz if tz.len() == 6 && matches!(tz.as_bytes()[0], b'+' | b'-') && tz.as_bytes()[3] == b':' => {
            let (oh, om) = (num(i + 1..i + 3)?, num(i + 4..i + 6)?);
            if oh > 23 || om > 59 {
                return None;
            }
            let sign = if tz.starts_with('-') { -1 } else { 1 };
            sign * (oh * 3600 + om * 60)
        }
        _ => return None,
    };
    let days = days_from_civil(y, mo, d);
    let ms = (days * 86_400 + h * 3600 + mi * 60 + sec - offset_secs) * 1000 + frac_ms;
    // An offset or a leap second may leave years 0000 to 9999, which no
    // RFC 3339 time in UTC can write back.
    (FIRST_MS..=LAST_MS).contains(&ms).then_some(ms)
}

/// 0000-01-01T00:00:00.000Z and 9999-12-31T23:59:59.999Z.
const FIRST_MS: i64 = -62_167_219_200_000;
const LAST_MS: i64 = 253_402_300_799_999;

// Howard Hinnant's algorithms (http://howardhinnant.github.io/date_algorithms.html).
fn civil_from_days(z: i64) -> (i64, i64, i64) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    (yoe + era * 400 + i64::from(m <= 2), m, d)
}

fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let mp = if m > 2 { m - 3 } else { m + 9 };
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_round_trip() {
        for ms in [0i64, 1_700_000_000_123, 951_782_400_000, 4_102_444_799_999, -86_400_001] {
            assert_eq!(parse_rfc3339(&rfc3339(ms)), Some(ms), "{}", rfc3339(ms));
        }
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(rfc3339_seconds(1_700_000_000_123), "2023-11-14T22:13:20Z");
        assert_eq!(parse_rfc3339("2023-11-14T22:13:20Z"), Some(1_700_000_000_000));
        assert_eq!(parse_rfc3339("2023-11-14T22:13:20.5Z"), Some(1_700_000_000_500));
        assert_eq!(parse_rfc3339("2023-11-14T22:13:20.123456Z"), Some(1_700_000_000_123));
        assert_eq!(parse_rfc3339("2023-11-15T00:13:20+02:00"), Some(1_700_000_000_000));
        assert_eq!(parse_rfc3339("2026-11-30T12:00:00Z"), parse_rfc3339("2026-11-30T12:00:00.000+00:00"));
        assert_eq!(parse_rfc3339("2024-02-29T00:00:00Z").map(rfc3339_seconds).as_deref(), Some("2024-02-29T00:00:00Z"));
        for bad in ["2023-11-14 22:13:20", "tomorrow", "2023-13-14T22:13:20Z", "2023-11-14T22:13:20.Z", ""] {
            assert_eq!(parse_rfc3339(bad), None, "{bad}");
        }
    }

    /// Found by the invariant of fuzz/fuzz_targets/rfc3339.rs (a parsed time
    /// written back parses to the same instant), on inputs at the ends of
    /// the years: an offset or a leap second took the instant out of years
    /// 0000 to 9999, and it was written as no RFC 3339 time ("-001-12-31..."
    /// or "10000-01-01...").
    #[test]
    fn times_outside_years_0000_to_9999_are_refused() {
        for bad in ["0000-01-01T00:30:00+01:00", "9999-12-31T23:59:60Z", "9999-12-31T23:00:00-01:00"] {
            assert_eq!(parse_rfc3339(bad), None, "{bad}");
        }
        for edge in ["0000-01-01T00:00:00Z", "0000-01-01T01:00:00+01:00", "9999-12-31T23:59:59.999Z"] {
            let ms = parse_rfc3339(edge).expect(edge);
            assert_eq!(parse_rfc3339(&rfc3339(ms)), Some(ms), "{edge}");
        }
    }
}
