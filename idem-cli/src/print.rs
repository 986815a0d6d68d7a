//! What `idem` prints: a table or lines for people, JSON for scripts (`--json`).

use std::time::Duration;

use idem_runtime::admin::{Entry, Page, Verdict};
use idem_runtime::store::Holder;
use idem_runtime::Key;
use serde_json::{json, Value};

/// A duration as people read it: `4m 12s`, `850ms`.
fn human(duration: Duration) -> String {
    let ms = duration.as_millis();
    if ms < 1_000 {
        return format!("{ms}ms");
    }
    let secs = duration.as_secs();
    let (h, m, s) = (secs / 3_600, secs / 60 % 60, secs % 60);
    match (h, m) {
        (0, 0) => format!("{s}s"),
        (0, _) => format!("{m}m {s}s"),
        _ => format!("{h}h {m}m {s}s"),
    }
}

fn millis(duration: Option<Duration>) -> Value {
    duration.map_or(Value::Null, |d| {
        json!(u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
    })
}

/// An entry as JSON; its value only when it carries one.
fn entry_json(entry: &Entry) -> Value {
    let holder = entry.holder().map(|h| {
        json!({ "host": h.host(), "pid": h.pid(), "started_ms": h.started_ms(), "exited": h.has_exited() })
    });
    let value = entry
        .value_json()
        .and_then(|text| serde_json::from_str::<Value>(text).ok());
    let steps: Vec<Value> = entry
        .steps()
        .iter()
        .map(|(key, size)| json!({ "key": key.to_hex(), "size": size }))
        .collect();
    json!({
        "key": entry.key().to_hex(),
        "namespace": entry.namespace(),
        "label": entry.label(),
        "state": entry.state().as_str(),
        // A string: a Redis token is beyond 2^53, which `jq` 1.6 and JavaScript round.
        "token": entry.token().map(|t| t.get().to_string()),
        "lease_ms": millis(entry.lease()),
        "lease_left_ms": millis(entry.lease_left()),
        "renewed_ago_ms": millis(entry.renewed_ago()),
        "silent": entry.token().map(|_| entry.is_silent()),
        "holder": holder,
        "expires_in_ms": millis(entry.expires_in()),
        "size": entry.size(),
        "value": value,
        "steps": steps,
    })
}

/// A holder, and whether its process is known to have exited.
fn holder(holder: &Holder) -> String {
    if holder.has_exited() {
        format!("{holder} (exited)")
    } else {
        holder.to_string()
    }
}

fn or_dash(text: Option<String>) -> String {
    text.unwrap_or_else(|| "-".to_string())
}

/// One page: a header on the first, a row an entry, and the cursor of the next.
pub(crate) fn page(page: &Page, json: bool, first: bool) {
    if json {
        let entries: Vec<Value> = page.entries().iter().map(entry_json).collect();
        let next = page.next().map(|cursor| cursor.to_string());
        println!("{}", json!({ "entries": entries, "next": next }));
        return;
    }
    if first {
        println!(
            "{:<64}  {:<9}  {:>8}  {:>10}  {:>10}  {:<28}  {:>10}  {:>8}  NAMESPACE  LABEL",
            "KEY", "STATE", "TOKEN", "LEASE LEFT", "RENEWED", "HOLDER", "EXPIRES IN", "SIZE"
        );
    }
    if first && page.entries().is_empty() {
        println!("(no records)");
    }
    for entry in page.entries() {
        let renewed = entry.renewed_ago().map(|ago| {
            let silent = if entry.is_silent() { " !" } else { "" };
            format!("{}{silent}", human(ago))
        });
        println!(
            "{:<64}  {:<9}  {:>8}  {:>10}  {:>10}  {:<28}  {:>10}  {:>8}  {}  {}",
            entry.key().to_hex(),
            entry.state().as_str(),
            or_dash(entry.token().map(|t| t.get().to_string())),
            or_dash(entry.lease_left().map(human)),
            or_dash(renewed),
            or_dash(entry.holder().map(holder)),
            or_dash(entry.expires_in().map(human)),
            or_dash(entry.size().map(|s| s.to_string())),
            entry.namespace().unwrap_or("(namespace unknown)"),
            entry.label().unwrap_or("-"),
        );
    }
    if let Some(next) = page.next() {
        println!("next page: --after {next}");
    }
}

/// One call, whole.
pub(crate) fn entry(entry: &Entry, json: bool) {
    if json {
        println!("{}", entry_json(entry));
        return;
    }
    let line = |name: &str, value: String| println!("{name:<12} {value}");
    line("key", entry.key().to_hex());
    line(
        "namespace",
        entry
            .namespace()
            .unwrap_or("(namespace unknown)")
            .to_string(),
    );
    if let Some(label) = entry.label() {
        line("label", label.to_string());
    }
    line("state", entry.state().as_str().to_string());
    if let Some(token) = entry.token() {
        line("token", token.get().to_string());
        line("lease", or_dash(entry.lease().map(human)));
        line("lease left", or_dash(entry.lease_left().map(human)));
        let silent = if entry.is_silent() {
            "silent: no renewal for more than half its lease"
        } else {
            "alive: it renews"
        };
        line(
            "renewed",
            format!("{} ago ({silent})", or_dash(entry.renewed_ago().map(human))),
        );
        line(
            "holder",
            or_dash(entry.holder().map(|h| {
                format!(
                    "{} (taking claims since {} ms after the epoch)",
                    holder(h),
                    h.started_ms()
                )
            })),
        );
    }
    if let Some(expires) = entry.expires_in() {
        line("expires in", human(expires));
    }
    if let Some(size) = entry.size() {
        line("size", format!("{size} bytes"));
    }
    if let Some(value) = entry.value_json() {
        line("value", value.to_string());
    }
    if !entry.steps().is_empty() {
        line("steps", entry.steps().len().to_string());
        for (key, size) in entry.steps() {
            println!("  {} ({size} bytes)", key.to_hex());
        }
    }
}

pub(crate) fn missing(key: &Key, json: bool) {
    if json {
        println!("{}", json!({ "key": key.to_hex(), "found": false }));
    } else {
        eprintln!("idem: there is no record of {}", key.to_hex());
    }
}

/// Nothing found by a search (`what` says what was looked for).
pub(crate) fn none(what: &str, json: bool) {
    if json {
        println!("{}", json!({ "found": false, "searched": what }));
    } else {
        eprintln!("idem: {what}");
    }
}

pub(crate) fn key(key: &Key, json: bool) {
    if json {
        println!("{}", json!({ "key": key.to_hex() }));
    } else {
        println!("{}", key.to_hex());
    }
}

pub(crate) fn verdict(key: &Key, done: &str, verdict: &Verdict, json: bool) {
    let refusal = match verdict {
        Verdict::Refused(refusal) => Some(refusal.to_string()),
        _ => None,
    };
    if json {
        println!(
            "{}",
            json!({ "key": key.to_hex(), "done": refusal.is_none(), "refused": refusal })
        );
        return;
    }
    match refusal {
        None => println!("{done} {}", key.to_hex()),
        Some(why) => eprintln!("idem: refused, nothing changed: {why}"),
    }
}

pub(crate) fn purged(count: u64, json: bool) {
    if json {
        println!("{}", json!({ "purged": count }));
    } else {
        println!("purged {count} expired records");
    }
}

#[cfg(test)]
mod tests {
    use super::human;
    use std::time::Duration;

    #[test]
    fn durations_read_as_people_say_them() {
        assert_eq!(human(Duration::from_millis(850)), "850ms");
        assert_eq!(human(Duration::from_secs(252)), "4m 12s");
        assert_eq!(human(Duration::from_secs(3_725)), "1h 2m 5s");
    }
}
