//! What the bench programs share: the recorded value and the runtime they run on.

use serde::{Deserialize, Serialize};

/// A small struct result, as a payment call returns: about 70 bytes of JSON.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Receipt {
    pub id: u64,
    pub customer: String,
    pub cents: u64,
    pub currency: String,
}

pub fn receipt(id: u64) -> Receipt {
    Receipt {
        id,
        customer: "cus_0042".into(),
        cents: 1999,
        currency: "EUR".into(),
    }
}

/// A tokio runtime with the 2 workers of the machine the figures come from.
#[allow(dead_code)] // the instruction counts run on one thread
pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// A number no earlier run started from (nanoseconds since the epoch), to count fresh keys
/// from: the stores keep records for a day, and a key an earlier run recorded would replay
/// where a first execution is meant.
#[allow(dead_code)] // the footprint bench derives no fresh keys
pub fn run_start() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

/// The least a hand-written client keeping idem's guarantees sends to Redis 7.0: the floor
/// of `paths`' P6f and of the throughput bench's Redis floor rows.
#[allow(dead_code)] // the footprint and phases benches measure no floor
#[cfg(feature = "redis")]
pub mod redis_floor {
    use std::sync::LazyLock;

    use redis::aio::ConnectionManager;
    use sha2::{Digest, Sha256};

    /// The key of number `n`: a SHA-256 digest in hex, in a hash tag.
    pub fn key(n: u64) -> Vec<u8> {
        let mut digits = [0; 64];
        hex::encode_to_slice(Sha256::digest(n.to_be_bytes()), &mut digits).unwrap();
        [&b"idem-bench:floor:{"[..], &digits, b"}"].concat()
    }

    /// The in-progress record of `n`'s claim: 30 bytes, as idem's, with a token of its own.
    fn claim_record(n: u64) -> [u8; 30] {
        let mut record = [b'p'; 30];
        record[1..9].copy_from_slice(&n.to_be_bytes());
        record
    }

    /// Claims `key` for `n` in one round trip: `None` when claimed, else the record there.
    pub async fn claim(con: &mut ConnectionManager, key: &[u8], n: u64) -> Option<Vec<u8>> {
        redis::cmd("SET")
            .arg(key)
            .arg(&claim_record(n)[..])
            .arg("NX")
            .arg("GET")
            .arg("PX")
            .arg(30_000)
            .query_async(con)
            .await
            .unwrap()
    }

    /// Records `value` on `key` while it still holds `n`'s claim (a compare-and-set script:
    /// Redis 7 has no native one); whether it did.
    pub async fn complete(con: &mut ConnectionManager, key: &[u8], n: u64, value: &[u8]) -> bool {
        static COMPLETE: LazyLock<redis::Script> = LazyLock::new(|| {
            redis::Script::new(
                "if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end \
                 redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3]) return 1",
            )
        });
        let record = [&b"c"[..], value].concat();
        COMPLETE
            .key(key)
            .arg(&claim_record(n)[..])
            .arg(record)
            .arg(60_000)
            .invoke_async::<i64>(con)
            .await
            .unwrap()
            == 1
    }
}
