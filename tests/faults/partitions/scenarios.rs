//! One holder cut off mid-body, and partitions at random points, on Redis and PostgreSQL.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_cut_off_from_redis_is_fenced_after_the_takeover() {
    a_holder_cut_off_is_fenced_after_the_takeover(Kind::Redis).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_cut_off_from_postgres_is_fenced_after_the_takeover() {
    a_holder_cut_off_is_fenced_after_the_takeover(Kind::Postgres).await;
}

async fn a_holder_cut_off_is_fenced_after_the_takeover(kind: Kind) {
    let Some(mut hosts) = Hosts::start(kind).await else {
        return;
    };
    let key = "held";
    hosts.a.say(&format!("run {key} hold 0"));
    let claimed = hosts.a.line_with("claimed held").await;
    let first: u64 = event(&claimed, "claimed", key).unwrap()[0].parse().unwrap();

    hosts.network.cut("a", "store");
    let cut = Instant::now();
    // The other instance waits out the lease, takes the key over, writes downstream and
    // records.
    hosts.b.say(&format!("run {key} go 0"));
    let owner = ended(&event(&hosts.b.line_with("outcome held").await, "outcome", key).unwrap());
    let took_over = cut.elapsed();
    let Ended::Executed(owner) = owner else {
        panic!("the instance that still reaches the store must run the body: {owner:?}");
    };
    assert_eq!(owner.by, 'b');
    assert!(owner.token > first, "{owner:?} after token {first}");

    hosts.network.heal("a", "store");
    let healed = Instant::now();
    hosts.a.say(&format!("finish {key}"));
    let wrote = hosts.a.line_with("wrote held").await;
    assert_eq!(
        event(&wrote, "wrote", key).unwrap(),
        [first.to_string().as_str(), "refused"],
        "the zombie's downstream write carries its token, and is refused"
    );
    let zombie = ended(&event(&hosts.a.line_with("outcome held").await, "outcome", key).unwrap());
    let zombie_answered = healed.elapsed();
    assert!(
        matches!(&zombie, Ended::Failed(e) if e.starts_with("the body ran")),
        "the zombie's completion is fenced: it is told its body ran unrecorded (`Unrecorded`), never a replay: {zombie:?}"
    );

    // Not stuck: the instance that was cut off replays the key at once.
    let again = Instant::now();
    hosts.a.say(&format!("run {key} go 0"));
    let replay = ended(&event(&hosts.a.line_with("outcome held").await, "outcome", key).unwrap());
    assert_eq!(replay, Ended::Replayed(owner));
    let replayed_in = again.elapsed();

    assert_eq!(hosts.recorded(key).await, Some(owner));
    let writes = hosts.downstream.writes(key);
    let landed: Vec<_> = writes.iter().filter(|w| w.landed).collect();
    assert_eq!(landed.len(), 1, "one effect landed: {writes:?}");
    assert_eq!((landed[0].by, landed[0].token), (owner.by, owner.token));
    println!(
        "{kind:?}, partition of the holder (lease {LEASE:?}): the other instance ran the key {took_over:?} \
         after the cut; after the heal, the zombie's write was refused and its completion \
         fenced ({zombie_answered:?}); the key replayed in {replayed_in:?}"
    );
}

/// One partition at a random point, counted.
#[derive(Debug, Default)]
struct Count {
    keys: usize,
    /// Bodies of the cut-off instance that finished and whose completion the store refused
    /// (answered `Unrecorded`).
    fenced: usize,
    /// Its downstream writes refused for their stale token.
    refused: usize,
    /// Keys whose body ran in both instances: the first one's effect landed and its record
    /// did not (the cut came between the two, and lasted past the lease); both effects
    /// landed, in token order, and the record is the second's. Only a downstream that
    /// deduplicates by `attempt().key()` makes these once.
    ran_twice: usize,
    /// Of those, the calls of the cut-off instance answered with their own, unrecorded value
    /// (every attempt to record it failed until the lease ran out).
    unrecorded: usize,
    /// Calls of the cut-off instance that ended with an error (its store unreachable).
    failed: usize,
    /// The longest time from a cut until the other instance had an answer for every key.
    recovered: Duration,
    /// The longest time from a heal until the cut-off instance had answered every call.
    healed: Duration,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partitions_from_redis_at_random_points_leave_one_outcome_per_key() {
    partitions_at_random_points_leave_one_outcome_per_key(Kind::Redis).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partitions_from_postgres_at_random_points_leave_one_outcome_per_key() {
    partitions_at_random_points_leave_one_outcome_per_key(Kind::Postgres).await;
}

async fn partitions_at_random_points_leave_one_outcome_per_key(kind: Kind) {
    let Some(mut hosts) = Hosts::start(kind).await else {
        return;
    };
    let rounds: usize = std::env::var("IDEM_PARTITIONS").map_or(4, |n| n.parse().unwrap());
    // A new schedule each run, printed so that a failure can be run again
    // (`IDEM_PARTITION_SEED=<seed>`).
    let seed = std::env::var("IDEM_PARTITION_SEED").map_or_else(
        |_| {
            let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH);
            now.unwrap().as_nanos() as u64
        },
        |seed| seed.parse().unwrap(),
    );
    let mut rng = rand_xorshift::XorShiftRng::seed_from_u64(seed);
    const KEYS: usize = 16;
    let mut count = Count::default();
    for round in 0..rounds {
        let keys: Vec<String> = (0..KEYS).map(|i| format!("r{round}k{i}")).collect();
        // Each key's call in the instance to be cut off is one of three: started before the
        // cut with a body of 0–20 ms (done, or finishing in the cut), started before the cut
        // with a body that goes on until after the heal (past the lease: a zombie), or
        // started after the cut. The cut comes 0–40 ms after the first call.
        let kinds: Vec<u8> = keys.iter().map(|_| rng.random_range(0..3)).collect();
        for (key, kind) in keys.iter().zip(&kinds) {
            match kind {
                0 => hosts
                    .a
                    .say(&format!("run {key} go {}", rng.random_range(0..20))),
                1 => hosts.a.say(&format!("run {key} hold 0")),
                _ => {}
            }
        }
        tokio::time::sleep(Duration::from_millis(rng.random_range(0..40))).await;
        hosts.network.cut("a", "store");
        let cut = Instant::now();
        for (key, _) in keys.iter().zip(&kinds).filter(|(_, kind)| **kind == 2) {
            hosts.a.say(&format!("run {key} go 0"));
        }
        for key in &keys {
            hosts.b.say(&format!("run {key} go 0"));
        }
        let b = outcomes(&mut hosts.b, KEYS).await;
        count.recovered = count.recovered.max(cut.elapsed());
        hosts.network.heal("a", "store");
        let healed = Instant::now();
        for (key, _) in keys.iter().zip(&kinds).filter(|(_, kind)| **kind == 1) {
            hosts.a.say(&format!("finish {key}"));
        }
        let a = outcomes(&mut hosts.a, KEYS).await;
        count.healed = count.healed.max(healed.elapsed());

        for key in &keys {
            let recorded = hosts.recorded(key).await.expect("every key recorded");
            let context = format!("seed {seed}, key {key}: {:?} {:?}", a[key], b[key]);
            match &b[key].ended {
                Ended::Executed(w) | Ended::Replayed(w) => assert_eq!(*w, recorded, "{context}"),
                Ended::Failed(e) => panic!("the instance that reaches the store failed: {e}"),
            }
            match &a[key].ended {
                Ended::Executed(w) if *w == recorded => {}
                Ended::Executed(w) => {
                    // Its body finished in the cut, and no attempt to record reached the store
                    // before the lease ran out: the caller has the value of the effect that
                    // happened, and the other instance ran the key again.
                    assert_eq!((w.by, recorded.by), ('a', 'b'), "{context}");
                    assert_eq!(a[key].wrote, Some(true), "{context}");
                    count.unrecorded += 1;
                }
                Ended::Replayed(w) => {
                    // A replay says the body did not run here.
                    assert_eq!(*w, recorded, "{context}");
                    assert_eq!(a[key].wrote, None, "{context}");
                }
                // `Unrecorded`: its body ran, and its completion was refused.
                Ended::Failed(e) if e.starts_with("the body ran") => {
                    count.fenced += usize::from(a[key].wrote.is_some());
                }
                Ended::Failed(_) => count.failed += 1,
            }
            let writes = hosts.downstream.writes(key);
            let landed: Vec<_> = writes.iter().filter(|w| w.landed).collect();
            let last = landed.last().expect("the recorded body wrote");
            assert_eq!(
                Written {
                    by: last.by,
                    token: last.token
                },
                recorded,
                "the record and the downstream's state come from one body ({context}, {writes:?})"
            );
            if let [first, second] = landed[..] {
                // Both bodies' effects: the first instance's, then the other's, fenced in order.
                assert_eq!((first.by, second.by), ('a', 'b'), "{context}: {writes:?}");
                assert!(first.token < second.token, "{context}: {writes:?}");
                count.ran_twice += 1;
            }
            assert!(landed.len() <= 2, "{context}: {writes:?}");
            count.refused += writes.iter().filter(|w| !w.landed).count();
            assert_eq!(
                a[key].wrote == Some(false),
                writes.iter().any(|w| w.by == 'a' && !w.landed),
                "{context}"
            );
        }
        count.keys += KEYS;
    }
    println!("{kind:?}, {rounds} partitions at random points (seed {seed}): {count:?}");
}

/// What one instance said about one call.
#[derive(Debug)]
struct Said {
    /// Its downstream write, when the body got that far: landed or not.
    wrote: Option<bool>,
    ended: Ended,
}

/// Reads an instance's lines until `calls` calls have ended.
async fn outcomes(instance: &mut Child, calls: usize) -> HashMap<String, Said> {
    let mut wrote = HashMap::new();
    let mut said = HashMap::new();
    while said.len() < calls {
        let line = instance.next_line().await;
        let words: Vec<&str> = line.split(' ').collect();
        match words[..] {
            ["wrote", key, _, answer] => {
                wrote.insert(key.to_string(), answer == "landed");
            }
            ["outcome", key, ..] => {
                let ended = ended(&words[2..]);
                let wrote = wrote.remove(key);
                said.insert(key.to_string(), Said { wrote, ended });
            }
            _ => {}
        }
    }
    said
}
