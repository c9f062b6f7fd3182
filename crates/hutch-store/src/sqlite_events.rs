//! The SQLite store's events, webhooks and webhook deliveries (called by
//! the [`crate::Store`] impl in `sqlite.rs`, each call one transaction).

use crate::*;
use rusqlite::types::Value;
use rusqlite::{params, params_from_iter, Connection, OptionalExtension};

pub(crate) fn last_event_id(c: &mut Connection) -> Result<i64> {
    Ok(c.query_row("SELECT COALESCE(MAX(id), 0) FROM events", [], |r| r.get(0))?)
}

pub(crate) fn append_events(c: &mut Connection, rows: &mut [EventRecord]) -> Result<u64> {
    let tx = c.transaction()?;
    let mut made = 0u64;
    {
        // The id is the table's (AUTOINCREMENT): one writer at a time, so
        // ids commit in their order.
        let mut ev =
            tx.prepare_cached("INSERT INTO events (at, owner, type, sandbox_id, body) VALUES (?1, ?2, ?3, ?4, ?5)")?;
        // The owner's webhooks that want this type (`*` or the type itself).
        let mut dl = tx.prepare_cached(
            "INSERT INTO webhook_deliveries (webhook_id, event_id, event_type, payload, status, attempts, created_at, next_at) \
             SELECT w.id, ?1, ?2, ?3, 'pending', 0, ?4, ?4 FROM webhooks w WHERE w.owner = ?5 AND w.enabled = 1 \
             AND EXISTS (SELECT 1 FROM json_each(w.events) WHERE value = '*' OR value = ?2)",
        )?;
        for r in rows.iter_mut() {
            ev.execute(params![r.at, r.owner, r.kind, r.sandbox_id, r.body])?;
            r.id = tx.last_insert_rowid();
            made += dl.execute(params![r.id, r.kind, r.body, r.at, r.owner])? as u64;
        }
    }
    tx.commit()?;
    Ok(made)
}

fn event_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<EventRecord> {
    Ok(EventRecord {
        id: r.get(0)?,
        at: r.get(1)?,
        owner: r.get(2)?,
        kind: r.get(3)?,
        sandbox_id: r.get(4)?,
        body: r.get(5)?,
    })
}

pub(crate) fn list_events(c: &mut Connection, q: &EventQuery) -> Result<Vec<EventRecord>> {
    let mut sql = String::from("SELECT id, at, owner, type, sandbox_id, body FROM events WHERE 1 = 1");
    let mut args: Vec<Value> = Vec::new();
    let arg = |sql: &mut String, args: &mut Vec<Value>, cond: &str, v: Value| {
        args.push(v);
        sql.push_str(&format!(" AND {cond} ?{}", args.len()));
    };
    if let Some(o) = &q.owner {
        arg(&mut sql, &mut args, "owner =", Value::Text(o.clone()));
    }
    if let Some(s) = &q.sandbox_id {
        arg(&mut sql, &mut args, "sandbox_id =", Value::Text(s.clone()));
    }
    if let Some(f) = q.from {
        arg(&mut sql, &mut args, "at >=", Value::Integer(f));
    }
    if let Some(t) = q.to {
        arg(&mut sql, &mut args, "at <=", Value::Integer(t));
    }
    if let Some(a) = q.after {
        arg(&mut sql, &mut args, "id >", Value::Integer(a));
    }
    if !q.kinds.is_empty() {
        let mut marks = Vec::new();
        for k in &q.kinds {
            args.push(Value::Text(k.clone()));
            marks.push(format!("?{}", args.len()));
        }
        sql.push_str(&format!(" AND type IN ({})", marks.join(", ")));
    }
    args.push(Value::Integer(i64::from(q.limit)));
    sql.push_str(&format!(" ORDER BY id LIMIT ?{}", args.len()));
    let mut st = c.prepare(&sql)?;
    let rows = st.query_map(params_from_iter(args), event_row)?.collect::<rusqlite::Result<Vec<_>>>()?;
    Ok(rows)
}

pub(crate) fn prune_events(c: &mut Connection, before: i64) -> Result<u64> {
    let tx = c.transaction()?;
    let n = tx.execute("DELETE FROM events WHERE at < ?1", [before])?;
    tx.execute("DELETE FROM webhook_deliveries WHERE created_at < ?1 AND status != 'pending'", [before])?;
    tx.commit()?;
    Ok(n as u64)
}

fn webhook_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<WebhookRecord> {
    webhook_at(r, 0)
}

/// A webhook from the row's columns `first..first + 9` (`WEBHOOK_COLS`).
fn webhook_at(r: &rusqlite::Row<'_>, first: usize) -> rusqlite::Result<WebhookRecord> {
    let events: String = r.get(first + 3)?;
    Ok(WebhookRecord {
        id: r.get(first)?,
        owner: r.get(first + 1)?,
        url: r.get(first + 2)?,
        events: parse_events(&events),
        secret: r.get(first + 4)?,
        created_at: r.get(first + 5)?,
        format: r.get(first + 6)?,
        name: r.get(first + 7)?,
        enabled: r.get(first + 8)?,
    })
}

/// The stored JSON array of types (written by `insert_webhook` only).
pub(crate) fn parse_events(json: &str) -> Vec<String> {
    // A JSON array of plain strings, as written below.
    let inner = json.trim().trim_start_matches('[').trim_end_matches(']');
    inner.split(',').map(|s| s.trim().trim_matches('"').to_owned()).filter(|s| !s.is_empty()).collect()
}

/// Types are `[a-z0-9._*]` (checked by the control plane): no escaping needed.
pub(crate) fn events_json(events: &[String]) -> String {
    let quoted: Vec<String> = events.iter().map(|e| format!("\"{}\"", e.replace(['"', '\\'], ""))).collect();
    format!("[{}]", quoted.join(","))
}

pub(crate) const WEBHOOK_COLS: &str = "id, owner, url, events, secret, created_at, format, name, enabled";

pub(crate) fn insert_webhook(c: &mut Connection, w: &WebhookRecord, max: u64) -> Result<bool> {
    let tx = c.transaction()?;
    let n: i64 = tx.query_row("SELECT COUNT(*) FROM webhooks WHERE owner = ?1", [&w.owner], |r| r.get(0))?;
    if n as u64 >= max {
        return Ok(false);
    }
    tx.execute(
        &format!("INSERT INTO webhooks ({WEBHOOK_COLS}) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)"),
        params![w.id, w.owner, w.url, events_json(&w.events), w.secret, w.created_at, w.format, w.name, w.enabled],
    )
    .map_err(crate::sqlite::conflict)?;
    tx.commit()?;
    Ok(true)
}

pub(crate) fn get_webhook(c: &mut Connection, id: &str) -> Result<Option<WebhookRecord>> {
    Ok(c.query_row(&format!("SELECT {WEBHOOK_COLS} FROM webhooks WHERE id = ?1"), [id], webhook_row).optional()?)
}

pub(crate) fn list_webhooks(c: &mut Connection, owner: Option<&str>) -> Result<Vec<WebhookRecord>> {
    let mut st = c.prepare(&format!(
        "SELECT {WEBHOOK_COLS} FROM webhooks WHERE ?1 IS NULL OR owner = ?1 ORDER BY created_at, id"
    ))?;
    let rows = st.query_map([owner], webhook_row)?.collect::<rusqlite::Result<Vec<_>>>()?;
    Ok(rows)
}

pub(crate) fn delete_webhook(c: &mut Connection, id: &str) -> Result<bool> {
    let tx = c.transaction()?;
    tx.execute("DELETE FROM webhook_deliveries WHERE webhook_id = ?1", [id])?;
    let n = tx.execute("DELETE FROM webhooks WHERE id = ?1", [id])?;
    tx.commit()?;
    Ok(n > 0)
}

pub(crate) fn update_webhook(c: &mut Connection, w: &WebhookRecord) -> Result<bool> {
    let n = c.execute(
        "UPDATE webhooks SET url = ?2, events = ?3, name = ?4, enabled = ?5 WHERE id = ?1",
        params![w.id, w.url, events_json(&w.events), w.name, w.enabled],
    )?;
    Ok(n > 0)
}

pub(crate) const DELIVERY_COLS: &str =
    "d.id, d.webhook_id, d.event_id, d.event_type, d.payload, d.status, d.attempts, \
     d.created_at, d.next_at, d.last_at, d.last_status, d.last_error";

fn delivery_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<DeliveryRecord> {
    let status: String = r.get(5)?;
    Ok(DeliveryRecord {
        id: r.get(0)?,
        webhook_id: r.get(1)?,
        event_id: r.get(2)?,
        event_type: r.get(3)?,
        payload: r.get(4)?,
        status: DeliveryStatus::parse(&status).unwrap_or(DeliveryStatus::Failed),
        attempts: r.get(6)?,
        created_at: r.get(7)?,
        next_at: r.get(8)?,
        last_at: r.get(9)?,
        last_status: r.get(10)?,
        last_error: r.get(11)?,
    })
}

pub(crate) fn list_deliveries(
    c: &mut Connection,
    webhook_id: &str,
    before: Option<i64>,
    limit: u32,
) -> Result<Vec<DeliveryRecord>> {
    let mut st = c.prepare(&format!(
        "SELECT {DELIVERY_COLS} FROM webhook_deliveries d WHERE d.webhook_id = ?1 AND (?2 IS NULL OR d.id < ?2) \
         ORDER BY d.id DESC LIMIT ?3"
    ))?;
    let rows = st.query_map(params![webhook_id, before, limit], delivery_row)?.collect::<rusqlite::Result<Vec<_>>>()?;
    Ok(rows)
}

/// Claims due deliveries no node holds (or whose claim ran out): one
/// writer at a time, so the select and the claim are one step.
pub(crate) fn claim_deliveries(
    c: &mut Connection,
    node: &str,
    now: i64,
    until: i64,
    limit: u32,
) -> Result<Vec<(DeliveryRecord, WebhookRecord)>> {
    let tx = c.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
    let rows = {
        let mut st = tx.prepare(&format!(
            "SELECT {DELIVERY_COLS}, w.id, w.owner, w.url, w.events, w.secret, w.created_at, w.format, w.name, w.enabled \
             FROM webhook_deliveries d JOIN webhooks w ON w.id = d.webhook_id \
             WHERE d.status = 'pending' AND d.next_at <= ?1 AND (d.claimed_until IS NULL OR d.claimed_until <= ?1) \
             ORDER BY d.next_at, d.id LIMIT ?2"
        ))?;
        let rows = st
            // The delivery's 12 columns, then the webhook's.
            .query_map(params![now, limit], |r| Ok((delivery_row(r)?, webhook_at(r, 12)?)))?
            .collect::<rusqlite::Result<Vec<_>>>()?;
        let mut claim =
            tx.prepare_cached("UPDATE webhook_deliveries SET claimed_by = ?2, claimed_until = ?3 WHERE id = ?1")?;
        for (d, _) in &rows {
            claim.execute(params![d.id, node, until])?;
        }
        rows
    };
    tx.commit()?;
    Ok(rows)
}

pub(crate) fn next_delivery_at(c: &mut Connection) -> Result<Option<i64>> {
    Ok(c.query_row(
        "SELECT MIN(MAX(next_at, COALESCE(claimed_until, 0))) FROM webhook_deliveries WHERE status = 'pending'",
        [],
        |r| r.get(0),
    )?)
}

pub(crate) fn record_attempt(c: &mut Connection, id: i64, node: &str, a: &Attempt) -> Result<bool> {
    let n = c.execute(
        "UPDATE webhook_deliveries SET status = ?2, attempts = attempts + 1, next_at = ?3, last_at = ?4, \
         last_status = ?5, last_error = ?6, claimed_by = NULL, claimed_until = NULL WHERE id = ?1 AND claimed_by = ?7",
        params![id, a.status.as_str(), a.next_at, a.at, a.http_status, a.error, node],
    )?;
    Ok(n > 0)
}
