//! Hosts of a test's own: Linux network namespaces joined by veth links, and partitions
//! between them.
//!
//! Each host is a namespace (`ip netns add`) with nothing but loopback; [`Network::link`]
//! joins two hosts (or a host and the test's own namespace, [`HERE`]) with a veth pair on a
//! /24 of its own. [`Network::cut`] makes a link drop every packet both ways, silently, as a
//! failed switch or a firewall does (a classic BPF program that answers "drop", attached to
//! both ends' egress with `tc`; this needs neither `iptables` nor the `netem` qdisc), and
//! [`Network::heal`] takes it away. Established TCP connections survive a cut: they stall,
//! retransmit, and resume after the heal.
//!
//! Making namespaces needs root. Where it cannot, [`Network::new`] says so and the test is
//! skipped loudly, or fails when `IDEM_REQUIRE_SERVICES=1` (CI).

use std::net::Ipv4Addr;
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};

use crate::unavailable;

/// The test's own namespace, as an end of a link.
pub const HERE: &str = "";

/// Namespaces of one test, deleted (with their links) on drop.
pub struct Network {
    /// Prefix of this network's namespace and interface names: `idem<pid>n<count>`.
    tag: String,
    /// The second octet of every address here: `10.<octet>.<link>.<1|2>`.
    octet: u8,
    hosts: Vec<String>,
    links: Vec<Link>,
}

/// A veth pair: its two ends, host and interface name, and the host's address on it.
struct Link {
    ends: [(String, String, Ipv4Addr); 2],
}

/// Networks made by this process so far (a part of every name, so two tests never share).
static MADE: AtomicU32 = AtomicU32::new(0);

impl Network {
    /// Makes one namespace per host name, each with its loopback up, or `None` (skipped)
    /// where namespaces cannot be made.
    pub fn new(hosts: &[&str]) -> Option<Self> {
        forget_networks_of_dead_processes();
        let pid = std::process::id();
        let count = MADE.fetch_add(1, Ordering::Relaxed);
        let octet = free_octet(pid, count)?;
        let mut network = Self {
            tag: format!("idem{pid}n{count}"),
            octet,
            hosts: Vec::new(),
            links: Vec::new(),
        };
        for host in hosts {
            let name = network.namespace(host);
            if let Err(e) = ip(&["netns", "add", &name]) {
                return unavailable("network namespaces (`ip netns add`, as root)", e);
            }
            network.hosts.push(name.clone());
            ip(&["-n", &name, "link", "set", "lo", "up"]).ok()?;
        }
        Some(network)
    }

    /// Joins `a` and `b` (a host, or [`HERE`]) with a link of their own.
    pub fn link(&mut self, a: &str, b: &str) {
        let index = self.links.len() + 1;
        let end = |host: &str, side: u8| {
            (
                host.to_string(),
                format!(
                    "v{}l{index}{}",
                    self.octet,
                    ['a', 'b'][usize::from(side) - 1]
                ),
                Ipv4Addr::new(10, self.octet, index as u8, side),
            )
        };
        let link = Link {
            ends: [end(a, 1), end(b, 2)],
        };
        let [(_, first, _), (_, second, _)] = &link.ends;
        ip(&["link", "add", first, "type", "veth", "peer", "name", second])
            .expect("make a veth pair");
        for (host, interface, address) in &link.ends {
            if !host.is_empty() {
                ip(&["link", "set", interface, "netns", &self.namespace(host)])
                    .expect("move a link end into its host");
            }
            let with = |args: &[&str]| self.in_host(host, args);
            ip(&with(&[
                "addr",
                "add",
                &format!("{address}/24"),
                "dev",
                interface,
            ]))
            .expect("address a link end");
            ip(&with(&["link", "set", interface, "up"])).expect("bring a link end up");
            tc(&with(&["qdisc", "add", "dev", interface, "clsact"]))
                .expect("attach the classifier a cut needs");
        }
        self.links.push(link);
    }

    /// The address at which `from` reaches `to` (over the link between them).
    pub fn address(&self, from: &str, to: &str) -> Ipv4Addr {
        let link = self.between(from, to);
        link.ends.iter().find(|(h, ..)| h == to).unwrap().2
    }

    /// Drops every packet on the link between `a` and `b`, both ways, from now on.
    pub fn cut(&self, a: &str, b: &str) {
        for (host, interface, _) in &self.between(a, b).ends {
            // A classic BPF program of one instruction, `ret #2`: in direct-action mode 2 is
            // TC_ACT_SHOT, drop the packet.
            let drop = [
                "filter",
                "add",
                "dev",
                interface,
                "egress",
                "bpf",
                "da",
                "bytecode",
                "1,6 0 0 2",
            ];
            tc(&self.in_host(host, &drop)).expect("cut a link");
        }
    }

    /// Lets the link between `a` and `b` carry packets again.
    pub fn heal(&self, a: &str, b: &str) {
        for (host, interface, _) in &self.between(a, b).ends {
            tc(&self.in_host(host, &["filter", "del", "dev", interface, "egress"]))
                .expect("heal a link");
        }
    }

    /// A command that runs `program` in `host`.
    pub fn command(&self, host: &str, program: impl AsRef<std::ffi::OsStr>) -> Command {
        let [ip, rest @ ..] = &self.within(host)[..] else {
            unreachable!()
        };
        let mut command = Command::new(ip);
        command.args(rest).arg(program);
        command
    }

    /// The words that run a program in `host`, before the program's own:
    /// `ip netns exec <namespace>`.
    pub fn within(&self, host: &str) -> Vec<String> {
        ["ip", "netns", "exec", &self.namespace(host)]
            .map(String::from)
            .to_vec()
    }

    fn between(&self, a: &str, b: &str) -> &Link {
        self.links
            .iter()
            .find(|link| {
                let [(x, ..), (y, ..)] = &link.ends;
                (x == a && y == b) || (x == b && y == a)
            })
            .unwrap_or_else(|| panic!("no link between {a:?} and {b:?}"))
    }

    fn namespace(&self, host: &str) -> String {
        format!("{}-{host}", self.tag)
    }

    /// The arguments of an `ip` or `tc` command that acts in `host`: `-n <namespace>` first,
    /// nothing for [`HERE`].
    fn in_host(&self, host: &str, args: &[&str]) -> Vec<String> {
        let mut all = Vec::new();
        if !host.is_empty() {
            all.extend(["-n".to_string(), self.namespace(host)]);
        }
        all.extend(args.iter().map(ToString::to_string));
        all
    }
}

impl Drop for Network {
    /// Deletes the namespaces: their processes must be gone (a namespace with a process in it
    /// lives on, unnamed, until that process exits); the links go with them.
    fn drop(&mut self) {
        for host in &self.hosts {
            let _ = ip(&["netns", "delete", host]);
        }
    }
}

/// An octet no address in this namespace uses as `10.<octet>.…`, chosen from the process id
/// and the count so that two test processes at once rarely even try the same one.
fn free_octet(pid: u32, count: u32) -> Option<u8> {
    let taken = match Command::new("ip").args(["-4", "-o", "addr"]).output() {
        Ok(out) => String::from_utf8_lossy(&out.stdout).into_owned(),
        Err(e) => return unavailable("iproute2's `ip` (to make test hosts)", e),
    };
    (0..200)
        .map(|i| 20 + ((pid.wrapping_mul(31).wrapping_add(count * 7 + i)) % 200) as u8)
        .find(|octet| !taken.contains(&format!("inet 10.{octet}.")))
}

/// Deletes the namespaces of test processes that died without dropping their [`Network`]
/// (a SIGKILLed test run): their names carry the pid.
fn forget_networks_of_dead_processes() {
    let Ok(out) = Command::new("ip").args(["netns", "list"]).output() else {
        return;
    };
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let name = line.split_whitespace().next().unwrap_or_default();
        let Some(pid) = name
            .strip_prefix("idem")
            .and_then(|rest| rest.split('n').next())
            .and_then(|pid| pid.parse::<u32>().ok())
        else {
            continue;
        };
        if !std::path::Path::new(&format!("/proc/{pid}")).exists() {
            let _ = ip(&["netns", "delete", name]);
        }
    }
}

fn ip<S: AsRef<str>>(args: &[S]) -> Result<(), String> {
    run_with("ip", args)
}

fn tc<S: AsRef<str>>(args: &[S]) -> Result<(), String> {
    run_with("tc", args)
}

fn run_with<S: AsRef<str>>(program: &str, args: &[S]) -> Result<(), String> {
    let args: Vec<&str> = args.iter().map(AsRef::as_ref).collect();
    crate::servers::run(program, &args)
}
