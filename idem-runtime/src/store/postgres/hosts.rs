//! libpq's multi-host URLs (`postgres://app@db1:5432,db2:5432/app`), which sqlx does not
//! parse: the store connects to the host that takes writes, and follows a promotion by
//! itself. A statement that fails on a connection (the primary gone in a failover) has the
//! hosts probed again, one probe at a time, and the store's pools pointed at the host that
//! is not in recovery; the completions the engine retries meanwhile land there.

use std::str::FromStr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgPool};
use sqlx::{ConnectOptions, Connection};

use crate::Error;

/// The hosts of a multi-host URL, and which one the store's pools connect to.
pub(super) struct Hosts {
    /// Each host's `host:port`, for the logs, and its options.
    hosts: Vec<(String, PgConnectOptions)>,
    /// The index of the host the pools connect to.
    current: AtomicUsize,
    /// Whether a probe runs: one at a time.
    probing: AtomicBool,
}

impl Hosts {
    /// The hosts of `url`, if it names more than one (`None`: an ordinary URL, for sqlx).
    /// `target_session_attrs` is accepted and left out: the store always looks for the
    /// host that takes writes.
    pub(super) fn parse(url: &str) -> Result<Option<Self>, Error> {
        let invalid = |why: &str| Error::store(format!("invalid PostgreSQL URL: {why}"));
        let Some((scheme, rest)) = url.split_once("://") else {
            return Ok(None);
        };
        let end = rest.find(['/', '?']).unwrap_or(rest.len());
        let (authority, tail) = rest.split_at(end);
        let (user, hosts) = match authority.rsplit_once('@') {
            Some((user, hosts)) => (format!("{user}@"), hosts),
            None => (String::new(), authority),
        };
        if !hosts.contains(',') {
            return Ok(None);
        }
        let tail = without_target_session_attrs(tail);
        let hosts = hosts
            .split(',')
            .map(|host| {
                if host.is_empty() {
                    return Err(invalid("an empty host in the list"));
                }
                let single = format!("{scheme}://{user}{host}{tail}");
                let options = PgConnectOptions::from_str(&single).map_err(Error::store)?;
                Ok((host.to_string(), options))
            })
            .collect::<Result<Vec<_>, Error>>()?;
        Ok(Some(Self {
            hosts,
            current: AtomicUsize::new(0),
            probing: AtomicBool::new(false),
        }))
    }

    /// The options of the host the pools connect to.
    pub(super) fn current(&self) -> PgConnectOptions {
        self.hosts[self.current.load(Ordering::Acquire)].1.clone()
    }

    /// Finds the host that takes writes (connected, and not in recovery), each host given
    /// `timeout`, and makes it the current one.
    pub(super) async fn find_writable(&self, timeout: Duration) -> Result<(), Error> {
        let mut tried = Vec::new();
        for (index, (name, options)) in self.hosts.iter().enumerate() {
            match tokio::time::timeout(timeout, takes_writes(options)).await {
                Ok(Ok(true)) => {
                    let before = self.current.swap(index, Ordering::AcqRel);
                    if before != index {
                        tracing::info!(host = %name, "following the writable PostgreSQL host");
                    }
                    return Ok(());
                }
                Ok(Ok(false)) => tried.push(format!("{name}: in recovery")),
                Ok(Err(err)) => tried.push(format!("{name}: {err}")),
                Err(_) => tried.push(format!("{name}: no answer within {timeout:?}")),
            }
        }
        Err(Error::store(format!(
            "no PostgreSQL host takes writes ({})",
            tried.join("; ")
        )))
    }

    /// After a statement failed on a connection: probes the hosts in a task of its own
    /// (unless one probe already runs) and points `pools` at the host that takes writes.
    pub(super) fn follow(self: &Arc<Self>, pools: [&PgPool; 2], timeout: Duration) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        if self.probing.swap(true, Ordering::AcqRel) {
            return;
        }
        let hosts = Arc::clone(self);
        let pools = pools.map(PgPool::clone);
        runtime.spawn(async move {
            let before = hosts.current.load(Ordering::Acquire);
            if hosts.find_writable(timeout).await.is_ok()
                && hosts.current.load(Ordering::Acquire) != before
            {
                for pool in &pools {
                    pool.set_connect_options(hosts.current());
                }
            }
            // At most one probe every tenth of a second, however many statements fail.
            tokio::time::sleep(Duration::from_millis(100)).await;
            hosts.probing.store(false, Ordering::Release);
        });
    }
}

/// Whether the server of `options` takes writes: reachable, and not a standby.
async fn takes_writes(options: &PgConnectOptions) -> Result<bool, sqlx::Error> {
    let mut connection = options.connect().await?;
    let recovering: bool = sqlx::query_scalar("SELECT pg_is_in_recovery()")
        .fetch_one(&mut connection)
        .await?;
    let _ = connection.close().await;
    Ok(!recovering)
}

/// A connection of a multi-host store's pool must be to a host that takes writes: one that
/// is not (a standby, or an old primary that came back as one) is refused, and the failure
/// has the store look for the host that does.
pub(super) async fn refuse_standby(connection: &mut sqlx::PgConnection) -> Result<(), sqlx::Error> {
    let recovering: bool = sqlx::query_scalar("SELECT pg_is_in_recovery()")
        .fetch_one(&mut *connection)
        .await?;
    if recovering {
        return Err(sqlx::Error::Protocol(
            "the host is a standby (in recovery): it takes no writes".into(),
        ));
    }
    Ok(())
}

/// The path and query of a URL without its `target_session_attrs` parameter.
fn without_target_session_attrs(tail: &str) -> String {
    let Some((path, query)) = tail.split_once('?') else {
        return tail.to_string();
    };
    let kept: Vec<&str> = query
        .split('&')
        .filter(|pair| !pair.starts_with("target_session_attrs="))
        .collect();
    if kept.is_empty() {
        path.to_string()
    } else {
        format!("{path}?{}", kept.join("&"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_list_of_hosts_is_parsed_and_one_host_is_left_to_sqlx() {
        let hosts = Hosts::parse(
            "postgres://app:secret@db1:5432,db2:5433/app?target_session_attrs=read-write&sslmode=disable",
        )
        .unwrap()
        .unwrap();
        let names: Vec<_> = hosts.hosts.iter().map(|(name, _)| name.as_str()).collect();
        assert_eq!(names, ["db1:5432", "db2:5433"]);
        assert_eq!(hosts.hosts[1].1.get_host(), "db2");
        assert_eq!(hosts.hosts[1].1.get_port(), 5433);
        assert_eq!(hosts.hosts[1].1.get_database(), Some("app"));
        assert_eq!(hosts.hosts[1].1.get_username(), "app");
        assert!(Hosts::parse("postgres://app@db1:5432/app")
            .unwrap()
            .is_none());
        assert!(Hosts::parse("postgres://app@db1,,db2/app").is_err());
        assert_eq!(
            without_target_session_attrs("/app?target_session_attrs=primary"),
            "/app"
        );
    }
}
