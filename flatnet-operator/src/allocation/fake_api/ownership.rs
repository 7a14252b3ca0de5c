//! Field ownership, as the fake API server models server-side apply.
//!
//! A real server records, per object, which field manager owns which
//! fields (`metadata.managedFields`, one entry per manager, operation and
//! subresource). What our controllers' correctness depends on is modeled:
//!
//! - an apply (`PATCH` as `application/apply-patch+yaml`) by manager M
//!   owns the leaf fields it sets; when M applies again (to the same
//!   subresource: the object or its `status`), fields it owned before and
//!   leaves out now are removed, unless another manager owns them too;
//! - lists of [`MAP_LISTS`] (`conditions`, keyed by `type`, as
//!   `x-kubernetes-list-type: map` declares them) merge per key, each entry
//!   owned by the managers that applied it; other lists are atomic leaves,
//!   replaced whole;
//! - an apply of a value another manager owns with a different value takes
//!   the field over (`force=true`); of the same value, shares it;
//! - a non-apply write (create, update, merge patch, and
//!   [`super::FakeApiServer::insert`] as manager [`INSERTED`]) owns the
//!   fields whose value it changed, taking them from every other manager;
//!   its manager is the request's `fieldManager`, else [`UNKNOWN`];
//! - fields no longer in the object are owned by nobody.
//!
//! - an apply without `force` of a value another manager owns with a
//!   different value is refused ([`Owners::conflicts`]), as the real
//!   server's 409 Conflict names them; the fields of objects stored with
//!   [`super::FakeApiServer::insert`] (a test's seed, not a writer) never
//!   conflict.
//!
//! Not modeled: `managedFields` in the served objects (ownership is kept
//! beside them, so an apply that only changes ownership does not bump the
//! resourceVersion), `set` lists, map lists other than [`MAP_LISTS`] or keyed by
//! several fields, and the removal of parents left empty by a removal
//! (they stay as `{}`).

use std::collections::{BTreeMap, BTreeSet};

use serde_json::Value;

/// Lists merged per key (`x-kubernetes-list-type: map`): field name and key.
pub const MAP_LISTS: &[(&str, &str)] = &[("conditions", "type"), ("webhooks", "name")];

/// The manager of a non-apply write that names none.
pub const UNKNOWN: &str = "unknown";

/// The manager of objects stored with [`super::FakeApiServer::insert`].
pub const INSERTED: &str = "fake-api-insert";

/// Metadata the server owns: never a manager's field.
const SERVER_METADATA: &[&str] = &[
    "name",
    "namespace",
    "uid",
    "resourceVersion",
    "generation",
    "creationTimestamp",
    "deletionTimestamp",
    "managedFields",
    "selfLink",
];

/// One step of a field path: a field (`f:name`), or the entry of a map
/// list with a key (`k:value`), as `managedFields` spells them.
pub type FieldPath = Vec<String>;

/// The part of an object a write addresses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Scope {
    /// The object without its status.
    Object,
    /// The `status` subresource.
    Status,
}

/// How a manager wrote its fields.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Operation {
    Apply,
    Update,
}

/// The fields each manager owns in one object.
#[derive(Clone, Debug, Default)]
pub struct Owners {
    by_manager: BTreeMap<(String, Operation, Scope), BTreeSet<FieldPath>>,
}

impl Owners {
    /// Records an apply of `applied` by `manager` to `scope`, whose merge
    /// turned `stored` into `merged`; removes from `merged` the fields the
    /// manager applied before, omits now and nobody else owns.
    pub fn apply(
        &mut self,
        manager: &str,
        scope: Scope,
        stored: &Value,
        merged: &mut Value,
        applied: &Value,
    ) {
        let entry = (manager.to_owned(), Operation::Apply, scope);
        let now = fields(applied, scope);
        // Forced: a field set to another value changes hands.
        for (other, owned) in &mut self.by_manager {
            if *other != entry {
                owned.retain(|p| !now.contains(p) || !changed(stored, merged, p));
            }
        }
        let before = self.by_manager.remove(&entry).unwrap_or_default();
        for path in before.difference(&now) {
            if !self.owned(path) {
                remove(merged, path);
            }
        }
        self.by_manager.insert(entry, now);
        self.forget_missing(merged);
    }

    /// The fields an apply of `applied` by `manager` to `scope` would take
    /// from other managers, changing their value in `stored`: each with
    /// the manager owning it, as the real server names them
    /// (`"helm"`, or `"kubectl" using v1` for a non-apply writer).
    #[must_use]
    pub fn conflicts(
        &self,
        manager: &str,
        scope: Scope,
        stored: &Value,
        applied: &Value,
    ) -> Vec<(String, String)> {
        let mut out = Vec::new();
        for path in fields(applied, scope) {
            let value = get(applied, &path);
            if path.last().is_some_and(|s| s.starts_with("k:"))
                || get(stored, &path).is_none_or(|v| Some(v) == value)
            {
                continue;
            }
            for ((other, operation, _), owned) in &self.by_manager {
                if other != manager && other != INSERTED && owned.contains(&path) {
                    let who = match operation {
                        Operation::Apply => format!("{other:?}"),
                        Operation::Update => {
                            let version = applied["apiVersion"].as_str().unwrap_or("v1");
                            format!("{other:?} using {version}")
                        }
                    };
                    out.push((who, field_string(&path)));
                }
            }
        }
        out
    }

    /// Records a non-apply write by `manager` to `scope` that turned
    /// `stored` into `updated`.
    pub fn update(&mut self, manager: &str, scope: Scope, stored: &Value, updated: &Value) {
        let changed: BTreeSet<FieldPath> = fields(updated, scope)
            .into_iter()
            .filter(|p| changed(stored, updated, p))
            .collect();
        if !changed.is_empty() {
            for owned in self.by_manager.values_mut() {
                owned.retain(|p| !changed.contains(p));
            }
            self.by_manager
                .entry((manager.to_owned(), Operation::Update, scope))
                .or_default()
                .extend(changed);
        }
        self.forget_missing(updated);
    }

    /// Whether any manager owns `path` or a field below it.
    fn owned(&self, path: &FieldPath) -> bool {
        self.by_manager
            .values()
            .any(|owned| owned.iter().any(|p| p.starts_with(path)))
    }

    /// Drops the ownership of fields `value` no longer has.
    fn forget_missing(&mut self, value: &Value) {
        for owned in self.by_manager.values_mut() {
            owned.retain(|p| get(value, p).is_some());
        }
        self.by_manager.retain(|_, owned| !owned.is_empty());
    }
}

/// Whether a write turning `before` into `after` changed the field at
/// `path`; a map list entry changes only by appearing (its fields are
/// owned one by one).
fn changed(before: &Value, after: &Value, path: &FieldPath) -> bool {
    if path.last().is_some_and(|s| s.starts_with("k:")) {
        get(before, path).is_none()
    } else {
        get(before, path) != get(after, path)
    }
}

/// `path` as the real server prints a field: `.metadata.labels.a`,
/// `.webhooks[name="x"].clientConfig.caBundle`.
fn field_string(path: &[String]) -> String {
    let mut out = String::new();
    let mut list_key = None;
    for s in path {
        if let Some(field) = s.strip_prefix("f:") {
            out.push('.');
            out.push_str(field);
        } else if let (Some(key), Some(list_key)) = (s.strip_prefix("k:"), list_key) {
            out.push_str(&format!("[{list_key}={key}]"));
        }
        list_key = list_key_of(s);
    }
    out
}

/// The key field of the map list named `field`, if it is one.
fn map_list_key(field: &str) -> Option<&'static str> {
    MAP_LISTS
        .iter()
        .find(|(name, _)| *name == field)
        .map(|(_, key)| *key)
}

/// The path step of a map list entry with key `key`.
fn entry_step(key: &Value) -> String {
    format!("k:{key}")
}

/// The leaf fields `value` sets in `scope` (and the entries of its map
/// lists), without the fields the server owns.
#[must_use]
pub fn fields(value: &Value, scope: Scope) -> BTreeSet<FieldPath> {
    let mut out = BTreeSet::new();
    let Some(top) = value.as_object() else {
        return out;
    };
    for (name, child) in top {
        let in_scope = match scope {
            Scope::Status => name == "status",
            Scope::Object => name != "status" && name != "apiVersion" && name != "kind",
        };
        if !in_scope {
            continue;
        }
        if name == "metadata" {
            for (field, child) in child.as_object().into_iter().flatten() {
                if !SERVER_METADATA.contains(&field.as_str()) {
                    let path = vec!["f:metadata".to_owned(), format!("f:{field}")];
                    collect(child, Some(field), path, &mut out);
                }
            }
        } else {
            collect(child, Some(name), vec![format!("f:{name}")], &mut out);
        }
    }
    out
}

fn collect(value: &Value, name: Option<&str>, path: FieldPath, out: &mut BTreeSet<FieldPath>) {
    match value {
        Value::Object(fields) if !fields.is_empty() => {
            for (field, child) in fields {
                let mut path = path.clone();
                path.push(format!("f:{field}"));
                collect(child, Some(field), path, out);
            }
        }
        Value::Array(items) if !items.is_empty() => {
            if let Some(key) = name.and_then(map_list_key) {
                for item in items {
                    let mut path = path.clone();
                    path.push(entry_step(&item[key]));
                    out.insert(path.clone());
                    collect(item, None, path, out);
                }
            } else {
                out.insert(path);
            }
        }
        _ => {
            out.insert(path);
        }
    }
}

/// What one path step leads to from `value`; `list_key` is the key of
/// the map list `value` is, if it is one.
fn step<'a>(value: &'a Value, step: &str, list_key: Option<&str>) -> Option<&'a Value> {
    if let Some(field) = step.strip_prefix("f:") {
        return value.get(field);
    }
    let key: Value = serde_json::from_str(step.strip_prefix("k:")?).ok()?;
    let list_key = list_key?;
    value.as_array()?.iter().find(|item| item[list_key] == key)
}

/// The key of the map list a path step leads into.
fn list_key_of(step: &str) -> Option<&'static str> {
    step.strip_prefix("f:").and_then(map_list_key)
}

/// The value at `path`, if `value` has one.
#[must_use]
pub fn get<'a>(value: &'a Value, path: &[String]) -> Option<&'a Value> {
    let mut at = value;
    let mut list_key = None;
    for s in path {
        at = step(at, s, list_key)?;
        list_key = list_key_of(s);
    }
    Some(at)
}

/// Removes the field or map list entry at `path`, if present.
fn remove(value: &mut Value, path: &[String]) {
    let Some((last, parents)) = path.split_last() else {
        return;
    };
    let mut at = value;
    let mut list_key = None;
    for s in parents {
        let next = if let Some(field) = s.strip_prefix("f:") {
            at.get_mut(field)
        } else {
            let key: Option<Value> = s
                .strip_prefix("k:")
                .and_then(|k| serde_json::from_str(k).ok());
            match (key, list_key, at.as_array_mut()) {
                (Some(key), Some(list_key), Some(items)) => {
                    items.iter_mut().find(|item| item[list_key] == key)
                }
                _ => None,
            }
        };
        let Some(next) = next else {
            return;
        };
        at = next;
        list_key = list_key_of(s);
    }
    if let Some(field) = last.strip_prefix("f:") {
        if let Some(fields) = at.as_object_mut() {
            fields.remove(field);
        }
    } else if let (Some(key), Some(list_key), Some(items)) = (
        last.strip_prefix("k:")
            .and_then(|k| serde_json::from_str::<Value>(k).ok()),
        list_key,
        at.as_array_mut(),
    ) {
        items.retain(|item| item[list_key] != key);
    }
}

/// Merges an applied configuration into `target`: objects field by field,
/// [`MAP_LISTS`] entry by entry, anything else replaced; `null` removes.
pub fn merge(target: &mut Value, applied: &Value) {
    merge_named(target, applied, None);
}

fn merge_named(target: &mut Value, applied: &Value, name: Option<&str>) {
    match applied {
        Value::Object(fields) => {
            if !target.is_object() {
                *target = Value::Object(serde_json::Map::new());
            }
            let target = target.as_object_mut().expect("made an object above");
            for (field, value) in fields {
                if value.is_null() {
                    target.remove(field);
                } else {
                    let slot = target.entry(field.clone()).or_insert(Value::Null);
                    merge_named(slot, value, Some(field));
                }
            }
        }
        Value::Array(items) => match (name.and_then(map_list_key), target.as_array_mut()) {
            (Some(key), Some(existing)) => {
                for item in items {
                    match existing.iter_mut().find(|e| e[key] == item[key]) {
                        Some(slot) => merge_named(slot, item, None),
                        None => existing.push(item.clone()),
                    }
                }
            }
            _ => *target = applied.clone(),
        },
        _ => *target = applied.clone(),
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn path(steps: &[&str]) -> FieldPath {
        steps.iter().map(|s| (*s).to_owned()).collect()
    }

    /// Leaves, map list entries and their fields; atomic lists as one
    /// leaf; nothing the server owns; each scope its own part.
    #[test]
    fn fields_are_the_leaves_and_the_map_list_entries() {
        let object = json!({
            "apiVersion": "v1", "kind": "X",
            "metadata": {"name": "n", "resourceVersion": "3", "labels": {"a": "1"}},
            "spec": {"ports": [1, 2]},
            "status": {"phase": "Active", "conditions": [{"type": "Ready", "status": "True"}]},
        });
        let object_fields: Vec<FieldPath> = fields(&object, Scope::Object).into_iter().collect();
        assert_eq!(
            object_fields,
            [
                path(&["f:metadata", "f:labels", "f:a"]),
                path(&["f:spec", "f:ports"])
            ]
        );
        let ready = r#"k:"Ready""#;
        let status_fields: Vec<FieldPath> = fields(&object, Scope::Status).into_iter().collect();
        assert_eq!(
            status_fields,
            [
                path(&["f:status", "f:conditions", ready]),
                path(&["f:status", "f:conditions", ready, "f:status"]),
                path(&["f:status", "f:conditions", ready, "f:type"]),
                path(&["f:status", "f:phase"]),
            ]
        );
        let entry = path(&["f:status", "f:conditions", ready]);
        assert_eq!(
            get(&object, &entry),
            Some(&object["status"]["conditions"][0])
        );
        let mut without = object.clone();
        remove(&mut without, &entry);
        assert_eq!(without["status"]["conditions"], json!([]));
    }

    /// A map list merges by key; any other list is replaced; `null`
    /// removes a field.
    #[test]
    fn merge_joins_map_lists_by_key_and_replaces_other_lists() {
        let mut target = json!({"conditions": [{"type": "A", "status": "True"}],
                                "ports": [1, 2], "gone": 1});
        merge(
            &mut target,
            &json!({"conditions": [{"type": "B", "status": "False"},
                                   {"type": "A", "reason": "R"}],
                    "ports": [3], "gone": null}),
        );
        assert_eq!(
            target,
            json!({"conditions": [{"type": "A", "status": "True", "reason": "R"},
                                  {"type": "B", "status": "False"}],
                   "ports": [3]})
        );
    }
}
