//! How the client shows things to people: aligned tables, RFC 3339 times
//! and "in 9m" durations, and pretty JSON for scripts.

use serde::Serialize;

/// Columns padded to their widest cell, two spaces apart; the last column
/// is not padded, so lines carry no trailing blanks.
pub fn table(headers: &[&str], rows: &[Vec<String>]) -> String {
    let cols = headers.len();
    let mut widths: Vec<usize> = headers.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (i, cell) in row.iter().enumerate().take(cols) {
            widths[i] = widths[i].max(cell.chars().count());
        }
    }
    let mut out = String::new();
    let header_row: Vec<String> = headers.iter().map(|h| (*h).to_owned()).collect();
    for row in std::iter::once(&header_row).chain(rows) {
        let mut line = String::new();
        for (i, width) in widths.iter().enumerate() {
            let cell = row.get(i).map(String::as_str).unwrap_or("");
            line.push_str(cell);
            if i + 1 < cols {
                line.extend(std::iter::repeat_n(' ', width - cell.chars().count() + 2));
            }
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

/// Pretty JSON of an API type, with a trailing newline.
pub fn json<T: Serialize>(v: &T) -> anyhow::Result<String> {
    let mut s = serde_json::to_string_pretty(v)?;
    s.push('\n');
    Ok(s)
}

/// Milliseconds since the epoch as RFC 3339 UTC, to the second.
pub fn rfc3339(ms: i64) -> String {
    let secs = ms.div_euclid(1000);
    let days = secs.div_euclid(86_400);
    let tod = secs.rem_euclid(86_400);
    let (y, m, d) = civil_from_days(days);
    format!("{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z", tod / 3600, tod / 60 % 60, tod % 60)
}

/// RFC 3339 (`Z` or `±HH:MM`, optional fraction) to milliseconds since the
/// epoch; `None` when it is not one.
pub fn parse_rfc3339(s: &str) -> Option<i64> {
    let b = s.as_bytes();
    if b.len() < 20 || b[4] != b'-' || b[7] != b'-' || !matches!(b[10], b'T' | b't' | b' ') {
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
        if i == start {
            return None;
        }
        let digits = s.get(start..i.min(start + 3))?;
        frac_ms = digits.parse::<i64>().ok()? * 10i64.pow(3 - digits.len() as u32);
    }
    let offset_secs = match s.get(i..)? {
        "Z" | "z" => 0,
        tz if tz.len() == 6 && matches!(tz.as_bytes()[0], b'+' | b'-') && tz.as_bytes()[3] == b':' => {
            let oh = num(i + 1..i + 3)?;
            let om = num(i + 4..i + 6)?;
            let sign = if tz.starts_with('-') { -1 } else { 1 };
            sign * (oh * 3600 + om * 60)
        }
        _ => return None,
    };
    let days = days_from_civil(y, mo, d);
    Some((days * 86_400 + h * 3600 + mi * 60 + sec - offset_secs) * 1000 + frac_ms)
}

/// A span of milliseconds as people say it: `45s`, `9m30s`, `2h5m`, `3d4h`.
pub fn span(ms: i64) -> String {
    let s = ms.max(0) / 1000;
    match s {
        0..60 => format!("{s}s"),
        60..3600 => two(s / 60, "m", s % 60, "s"),
        3600..86_400 => two(s / 3600, "h", s / 60 % 60, "m"),
        _ => two(s / 86_400, "d", s / 3600 % 24, "h"),
    }
}

fn two(a: i64, ua: &str, b: i64, ub: &str) -> String {
    if b == 0 {
        format!("{a}{ua}")
    } else {
        format!("{a}{ua}{b}{ub}")
    }
}

/// An expiry relative to `now_ms`: `in 9m30s`, or `expired 2m ago`; the
/// text as given when it does not parse.
pub fn expires(at: &str, now_ms: i64) -> String {
    match parse_rfc3339(at) {
        Some(t) if t >= now_ms => format!("in {}", span(t - now_ms)),
        Some(t) => format!("{} ago", span(now_ms - t)),
        None => at.to_owned(),
    }
}

/// Milliseconds since the Unix epoch.
pub fn now_ms() -> i64 {
    hutch_control::keys::now_ms()
}

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
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
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
    fn tables_align_columns_without_trailing_blanks() {
        let t = table(
            &["ID", "STATE", "EXPIRES"],
            &[
                vec!["sb-1".into(), "running".into(), "in 9m".into()],
                vec!["sb-longer".into(), "suspended".into(), "".into()],
            ],
        );
        assert_eq!(t, "ID         STATE      EXPIRES\nsb-1       running    in 9m\nsb-longer  suspended\n");
        assert_eq!(table(&["A", "B"], &[]), "A  B\n");
    }

    #[test]
    fn times_round_trip() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339(1_700_000_000_123), "2023-11-14T22:13:20Z");
        assert_eq!(parse_rfc3339("2023-11-14T22:13:20Z"), Some(1_700_000_000_000));
        assert_eq!(parse_rfc3339("2023-11-14T22:13:20.5Z"), Some(1_700_000_000_500));
        assert_eq!(parse_rfc3339("2023-11-14T22:13:20.123456Z"), Some(1_700_000_000_123));
        assert_eq!(parse_rfc3339("2023-11-15T00:13:20+02:00"), Some(1_700_000_000_000));
        assert_eq!(parse_rfc3339("2024-02-29T00:00:00Z").map(rfc3339).as_deref(), Some("2024-02-29T00:00:00Z"));
        assert_eq!(parse_rfc3339("2023-11-14 22:13:20"), None);
        assert_eq!(parse_rfc3339("tomorrow"), None);
        assert_eq!(parse_rfc3339("2023-13-14T22:13:20Z"), None);
    }

    #[test]
    fn spans_and_expiries_read_naturally() {
        assert_eq!(span(45_000), "45s");
        assert_eq!(span(570_000), "9m30s");
        assert_eq!(span(600_000), "10m");
        assert_eq!(span(7_500_000), "2h5m");
        assert_eq!(span(3 * 86_400_000 + 4 * 3_600_000), "3d4h");
        let now = 1_700_000_000_000;
        assert_eq!(expires("2023-11-14T22:23:20Z", now), "in 10m");
        assert_eq!(expires("2023-11-14T22:11:20Z", now), "2m ago");
        assert_eq!(expires("garbage", now), "garbage");
    }
}
