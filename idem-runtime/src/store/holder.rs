//! Who a claim is: the operation it belongs to and the process that holds it, so that an
//! operator who finds a key held can tell whose it is and whether its holder still lives.

use std::fmt;
use std::sync::LazyLock;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::namespace::Namespace;

/// The process that holds a claim: its host's name, its process id, and when it began to
/// take claims (milliseconds since the Unix epoch), which tells a process from a later one
/// that reuses its id. Nothing secret: what `ps` on that host shows.
///
/// Stores write it as text, `host/pid/started`, beside a claim ([`Holder::encode`]).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Holder {
    host: String,
    pid: u32,
    started_ms: u64,
}

impl Holder {
    /// This process, as every claim it takes names it.
    pub fn this_process() -> &'static Self {
        static THIS: LazyLock<Holder> = LazyLock::new(|| Holder {
            host: host_name(),
            pid: std::process::id(),
            started_ms: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |since| {
                    u64::try_from(since.as_millis()).unwrap_or(u64::MAX)
                }),
        });
        &THIS
    }

    /// A holder, for stores that read one back and for tests.
    pub fn new(host: impl Into<String>, pid: u32, started_ms: u64) -> Self {
        Self {
            host: host.into(),
            pid,
            started_ms,
        }
    }

    /// The host's name, as the process saw it.
    pub fn host(&self) -> &str {
        &self.host
    }

    /// The process id on that host.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// When the process began to take claims, in milliseconds since the Unix epoch.
    pub fn started_ms(&self) -> u64 {
        self.started_ms
    }

    /// The text stores keep: `host/pid/started`.
    pub fn encode(&self) -> String {
        format!("{}/{}/{}", self.host, self.pid, self.started_ms)
    }

    /// Reads [`encode`](Self::encode)'s text back; `None` for anything else.
    pub fn decode(text: &str) -> Option<Self> {
        let mut parts = text.rsplitn(3, '/');
        let started_ms = parts.next()?.parse().ok()?;
        let pid = parts.next()?.parse().ok()?;
        let host = parts.next()?;
        Some(Self::new(host, pid, started_ms))
    }
}

impl fmt::Display for Holder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "pid {} on {}", self.pid, self.host)
    }
}

/// The host's name: the kernel's (Linux), else the environment's, else `unknown`.
fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|name| name.trim().to_owned())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .or_else(|| std::env::var("COMPUTERNAME").ok())
        .filter(|name| !name.is_empty())
        .unwrap_or_else(|| "unknown".to_owned())
}

/// What a claim says of itself beyond its key ([`Store::claim_as`](super::Store::claim_as)):
/// its operation's namespace, and a readable label if the caller chose one (none by
/// default: a key can hold an e-mail address). The holder is always
/// [`Holder::this_process`].
#[derive(Clone, Copy, Debug)]
pub struct Claimant<'a> {
    namespace: Option<&'a str>,
    label: Option<&'a str>,
    /// The engine's own handle on the name: a store in this process keeps it without a copy.
    shared: Option<&'a Namespace>,
}

impl<'a> Claimant<'a> {
    /// A claim of the operation `namespace`.
    pub const fn new(namespace: &'a str) -> Self {
        Self {
            namespace: Some(namespace),
            label: None,
            shared: None,
        }
    }

    /// A claim that says nothing of itself: what a store's `claim_with_nonce` passes to
    /// its own `claim_as`, so that each store has one claim.
    pub(crate) const fn unnamed() -> Self {
        Self {
            namespace: None,
            label: None,
            shared: None,
        }
    }

    /// The claim of the engine's operation `namespace`.
    pub(crate) fn of(namespace: &'a Namespace) -> Self {
        Self {
            namespace: Some(namespace),
            label: None,
            shared: Some(namespace),
        }
    }

    /// The namespace as a store in this process keeps it: shared, not copied, when the
    /// engine claims.
    #[cfg_attr(not(feature = "memory"), allow(dead_code))]
    pub(crate) fn kept(&self) -> Option<Namespace> {
        match self.shared {
            Some(shared) => Some(shared.clone()),
            None => self
                .namespace
                .map(|name| Namespace::from(std::borrow::Cow::Owned(name.to_owned()))),
        }
    }

    /// The same claim, with a readable label an operator's listing shows.
    #[must_use]
    pub const fn labelled(mut self, label: &'a str) -> Self {
        self.label = Some(label);
        self
    }

    /// The operation's namespace; `None` for a claim made without one
    /// ([`Store::claim_with_nonce`](super::Store::claim_with_nonce)).
    pub const fn namespace(&self) -> Option<&'a str> {
        self.namespace
    }

    /// The label, if the caller chose one.
    pub const fn label(&self) -> Option<&'a str> {
        self.label
    }

    /// The process that claims.
    pub fn holder(&self) -> &'static Holder {
        Holder::this_process()
    }
}

/// A live claim as [`Store::holding`](super::Store::holding) reads it: who holds it and how
/// long its lease has left.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Holding {
    /// How long the lease has left, by the store's clock.
    pub lease_left: Duration,
    /// The process that holds it, when the store keeps it (claims taken before the store
    /// kept holders have none).
    pub holder: Option<Holder>,
}

impl Holding {
    /// A holding, for store implementations.
    pub fn new(lease_left: Duration, holder: Option<Holder>) -> Self {
        Self { lease_left, holder }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_holder_reads_back_from_its_text_even_with_slashes_in_the_host() {
        let holder = Holder::new("pod/7", 42, 1_700_000_000_000);
        assert_eq!(holder.encode(), "pod/7/42/1700000000000");
        assert_eq!(Holder::decode(&holder.encode()), Some(holder));
        assert_eq!(Holder::decode("no pid"), None);
        let this = Holder::this_process();
        assert_eq!(this.pid(), std::process::id());
        assert!(!this.host().is_empty());
    }
}
