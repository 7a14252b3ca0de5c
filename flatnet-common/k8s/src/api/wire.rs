//! Serde adapters for the original's wire conventions: an address is its
//! textual form, an empty string means "unset", and a list or map may be
//! `null` (how Go writes an empty slice or map).

use std::net::IpAddr;

use serde::{Deserialize, Deserializer, Serializer};

/// Schema transform: drops the `default` values schemars derives from
/// `#[serde(default)]`. Those defaults exist for tolerant reading, not as API
/// defaults, and a default that violates the field's own schema (an empty
/// `flatMode`) would make the API server reject the CRD.
pub fn without_defaults(schema: &mut schemars::Schema) {
    if let Some(serde_json::Value::Object(properties)) = schema.get_mut("properties") {
        for property in properties.values_mut() {
            if let Some(property) = property.as_object_mut() {
                property.remove("default");
            }
        }
    }
}

/// Reads `null` as the type's default (an empty list or map).
pub fn null_as_default<'de, D, T>(de: D) -> Result<T, D::Error>
where
    D: Deserializer<'de>,
    T: Default + Deserialize<'de>,
{
    Ok(Option::<T>::deserialize(de)?.unwrap_or_default())
}

fn parse<E: serde::de::Error>(text: &str) -> Result<Option<IpAddr>, E> {
    let text = text.trim();
    if text.is_empty() {
        return Ok(None);
    }
    text.parse()
        .map(Some)
        .map_err(|_| E::custom(format_args!("{text:?} is not an IP address")))
}

/// `Option<IpAddr>` where `null`, a missing field and `""` all mean `None`.
pub mod optional {
    use super::*;

    /// Reads an address, `""` or `null`.
    pub fn deserialize<'de, D: Deserializer<'de>>(de: D) -> Result<Option<IpAddr>, D::Error> {
        match Option::<String>::deserialize(de)? {
            Some(text) => parse(&text),
            None => Ok(None),
        }
    }

    /// Writes the address text; pair with `skip_serializing_if = "Option::is_none"`.
    #[expect(
        clippy::ref_option,
        reason = "serde's `serialize_with` passes a reference to the field"
    )]
    pub fn serialize<S: Serializer>(ip: &Option<IpAddr>, ser: S) -> Result<S::Ok, S::Error> {
        match ip {
            Some(ip) => ser.collect_str(ip),
            None => ser.serialize_str(""),
        }
    }
}

/// `Vec<IpAddr>` where `null` is empty and `""` members are dropped.
pub mod list {
    use super::*;

    /// Reads a list of addresses.
    pub fn deserialize<'de, D: Deserializer<'de>>(de: D) -> Result<Vec<IpAddr>, D::Error> {
        let texts = Option::<Vec<String>>::deserialize(de)?.unwrap_or_default();
        let mut ips = Vec::with_capacity(texts.len());
        for text in texts {
            if let Some(ip) = parse::<D::Error>(&text)? {
                ips.push(ip);
            }
        }
        Ok(ips)
    }

    /// Writes the addresses as text.
    pub fn serialize<S: Serializer>(ips: &[IpAddr], ser: S) -> Result<S::Ok, S::Error> {
        ser.collect_seq(ips.iter().map(ToString::to_string))
    }
}
