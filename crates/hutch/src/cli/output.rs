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

pub use hutch_api::time::{now_ms, parse_rfc3339};

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
