//! A network prefix (`10.42.0.0/16`, `fd42::/56`) as given in the CIDR settings.

use std::{fmt, net::IpAddr, str::FromStr};

/// An address with a prefix length that fits its family.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cidr {
    /// The address as written (host bits are kept, as the original did).
    pub addr: IpAddr,
    /// Prefix length: at most 32 for IPv4, 128 for IPv6.
    pub prefix: u8,
}

/// Why a text is not a CIDR.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CidrError {
    /// No `/` or a bad address.
    #[error("{0:?} is not a CIDR such as 10.42.0.0/16")]
    Syntax(String),
    /// Prefix longer than the family allows.
    #[error("{0:?} has a prefix longer than its address family allows")]
    Prefix(String),
}

impl FromStr for Cidr {
    type Err = CidrError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let syntax = || CidrError::Syntax(text.to_owned());
        let (addr, prefix) = text.split_once('/').ok_or_else(syntax)?;
        let addr: IpAddr = addr.parse().map_err(|_| syntax())?;
        let prefix: u8 = prefix.parse().map_err(|_| syntax())?;
        let max = if addr.is_ipv4() { 32 } else { 128 };
        if prefix > max {
            return Err(CidrError::Prefix(text.to_owned()));
        }
        Ok(Self { addr, prefix })
    }
}

impl fmt::Display for Cidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix)
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn rejects_malformed_text() {
        for bad in [
            "",
            "10.0.0.0",
            "10.0.0.0/",
            "10.0.0/8",
            "x/8",
            "10.0.0.0/-1",
        ] {
            assert_eq!(
                bad.parse::<Cidr>(),
                Err(CidrError::Syntax(bad.into())),
                "{bad}"
            );
        }
        assert_eq!(
            "10.0.0.0/33".parse::<Cidr>(),
            Err(CidrError::Prefix("10.0.0.0/33".into()))
        );
        assert_eq!(
            "fd00::/129".parse::<Cidr>(),
            Err(CidrError::Prefix("fd00::/129".into()))
        );
    }

    proptest! {
        #[test]
        fn display_round_trips(addr: IpAddr, prefix in 0u8..=128) {
            let max = if addr.is_ipv4() { 32 } else { 128 };
            let text = format!("{addr}/{prefix}");
            match text.parse::<Cidr>() {
                Ok(cidr) => {
                    prop_assert!(prefix <= max);
                    prop_assert_eq!(cidr.to_string(), text);
                }
                Err(CidrError::Prefix(_)) => prop_assert!(prefix > max),
                Err(e) => prop_assert!(false, "unexpected {e}"),
            }
        }
    }
}
