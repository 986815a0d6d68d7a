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
/// Stores write it as text, `host/pid/started@machine`, beside a claim
/// ([`Holder::encode`]). The machine is the kernel's boot and process-id namespace (Linux),
/// so that an operator's tool on the same machine can tell a holder whose process exited
/// ([`has_exited`](Holder::has_exited)) from one it cannot see.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Holder {
    host: String,
    pid: u32,
    started_ms: u64,
    machine: Option<String>,
}

impl Holder {
    /// This process, as every claim it takes names it.
    pub fn this_process() -> &'static Self {
        static THIS: LazyLock<Holder> = LazyLock::new(|| Holder {
            host: host_name(),
            machine: machine(),
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
            machine: None,
        }
    }

    /// Whether the holder's process is known to have exited: it ran on this very machine
    /// (the same host, kernel boot and process-id namespace) and no process has its id now.
    /// `false` whenever that cannot be known (another machine or container, a holder
    /// written before machines were kept, a system without `/proc`), and when a process
    /// has its id, even one that reused it: a holder is never taken for dead by mistake.
    pub fn has_exited(&self) -> bool {
        let this = Self::this_process();
        let here = self.machine.is_some() && self.machine == this.machine && self.host == this.host;
        here && self.pid != this.pid
            && !std::path::Path::new(&format!("/proc/{}", self.pid)).exists()
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
        let mut text = format!("{}/{}/{}", self.host, self.pid, self.started_ms);
        if let Some(machine) = &self.machine {
            text.push('@');
            text.push_str(machine);
        }
        text
    }

    /// This process's [`encode`](Self::encode)d text, made once: what a store writes with
    /// every claim.
    #[cfg_attr(
        not(any(feature = "postgres", feature = "mysql", feature = "sqlite")),
        allow(dead_code)
    )]
    pub(crate) fn this_process_text() -> &'static str {
        static TEXT: LazyLock<String> = LazyLock::new(|| Holder::this_process().encode());
        &TEXT
    }

    /// Reads [`encode`](Self::encode)'s text back; `None` for anything else.
    pub fn decode(text: &str) -> Option<Self> {
        let (text, machine) = match text.rsplit_once('@') {
            Some((rest, machine)) if is_machine(machine) => (rest, Some(machine.to_owned())),
            _ => (text, None),
        };
        let mut parts = text.rsplitn(3, '/');
        let started_ms = parts.next()?.parse().ok()?;
        let pid = parts.next()?.parse().ok()?;
        let host = parts.next()?;
        let mut holder = Self::new(host, pid, started_ms);
        holder.machine = machine;
        Some(holder)
    }
}

impl fmt::Display for Holder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "pid {} on {}", self.pid, self.host)
    }
}

/// The host's name: the kernel's (Linux), else the environment's, else `unknown`.
/// This machine, as far as process ids go: the kernel's boot and this process's pid
/// namespace (`/proc`), or none where they cannot be read.
fn machine() -> Option<String> {
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").ok()?;
    let namespace = std::fs::read_link("/proc/self/ns/pid").ok()?;
    let namespace = namespace.to_string_lossy();
    let inode = namespace.trim_start_matches("pid:[").trim_end_matches(']');
    let boot: String = boot
        .trim()
        .chars()
        .filter(char::is_ascii_hexdigit)
        .take(12)
        .collect();
    let machine = format!("{boot}.{inode}");
    is_machine(&machine).then_some(machine)
}

/// Whether `text` is a machine as [`machine`] writes it.
fn is_machine(text: &str) -> bool {
    !text.is_empty() && text.chars().all(|c| c.is_ascii_alphanumeric() || c == '.')
}

fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|name| name.trim().to_owned())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .or_else(|| std::env::var("COMPUTERNAME").ok())
        .filter(|name| !name.is_empty())
        .unwrap_or_else(|| "unknown".to_owned())
}

/// What a claim says of itself beyond its key ([`ClaimRequest::claimant`](super::ClaimRequest::claimant)):
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

    /// A claim that says nothing of itself (a test's, or a tool's): listed as namespace
    /// unknown.
    pub const fn unnamed() -> Self {
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
    #[cfg_attr(not(any(feature = "memory", feature = "sqlite")), allow(dead_code))]
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
    /// ([`Claimant::unnamed`]).
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
        assert_eq!(Holder::decode(&this.encode()).as_ref(), Some(this));
    }

    #[test]
    fn a_holder_has_exited_only_when_its_machine_is_this_one_and_its_pid_is_free() {
        let this = Holder::this_process();
        assert!(!this.has_exited(), "this process runs");
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        child.wait().unwrap();
        let mut gone = Holder::decode(&this.encode()).unwrap();
        gone.pid = pid;
        if this.machine.is_some() {
            assert!(gone.has_exited(), "{gone:?}");
        }
        // Written elsewhere, or before machines were kept: never taken for dead.
        let mut elsewhere = gone.clone();
        elsewhere.machine = Some("0123456789ab.1".into());
        assert!(!elsewhere.has_exited());
        assert!(!Holder::new(this.host(), pid, 0).has_exited());
    }
}
