//! Values that JSON cannot carry as themselves: recorded as gone, so that the caller gets
//! its value and every retry `Error::Gone`, never a second run and never a record that
//! fails to decode until its TTL.

use idem_runtime::{step, Error, MemoryStore, Operation, Outcome};
use idem_tests::scenarios::namespace;

use super::Effect;

/// Runs a body returning `value()` under one key three times: its caller gets the value
/// (`is_it`), both retries `Error::Gone`, and the body runs once.
async fn answered_once_then_gone<T>(name: &str, value: fn() -> T, is_it: fn(&T) -> bool)
where
    T: serde::Serialize + serde::de::DeserializeOwned + std::fmt::Debug,
{
    let store = MemoryStore::new();
    let op = Operation::new(namespace(name));
    let key = op.key(&"call-1").unwrap();
    let runs = Effect::default();
    let call = || {
        let runs = runs.clone();
        async move {
            runs.run("effect").await?;
            Ok::<T, Error>(value())
        }
    };
    let first = op.run(&store, &key, None, call()).await.unwrap();
    assert!(
        matches!(&first, Outcome::Executed(value) if is_it(value)),
        "{first:?}"
    );
    for _ in 0..2 {
        let again = op.run(&store, &key, None, call()).await;
        assert!(matches!(again, Err(Error::Gone)), "{again:?}");
    }
    assert_eq!(
        runs.runs(),
        1,
        "the body ran once: a value with no record never releases"
    );
}

#[tokio::test]
async fn a_nan_result_answers_its_caller_and_gone_to_every_retry() {
    answered_once_then_gone("values_nan", || f64::NAN, |value| value.is_nan()).await;
}

/// A value whose `Serialize` fails: it has no record at all, and is recorded as gone too.
#[derive(Debug)]
struct Unserializable(u32);

impl serde::Serialize for Unserializable {
    fn serialize<S: serde::Serializer>(&self, _: S) -> Result<S::Ok, S::Error> {
        Err(serde::ser::Error::custom("this value cannot be encoded"))
    }
}

impl<'de> serde::Deserialize<'de> for Unserializable {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        u32::deserialize(deserializer).map(Self)
    }
}

#[tokio::test]
async fn a_value_that_fails_to_serialize_answers_its_caller_and_gone_to_every_retry() {
    answered_once_then_gone(
        "values_unserializable",
        || Unserializable(7),
        |value| value.0 == 7,
    )
    .await;
}

/// A step whose value cannot be recorded as itself: the body gets it, and a later attempt
/// that reaches the step gets `Error::Gone` instead of running its effect again.
#[tokio::test]
async fn a_step_whose_value_cannot_be_recorded_answers_gone_on_the_next_attempt() {
    let store = MemoryStore::new();
    let op = Operation::new(namespace("values_step_nan"));
    let key = op.key(&"order-9").unwrap();
    let measure = Effect::default();
    let attempt = |fail: bool| {
        let measure = measure.clone();
        async move {
            let value = step("measure", async {
                measure.run("measure").await?;
                Ok::<f64, Error>(f64::INFINITY)
            })
            .await?;
            if fail {
                return Err(Error::store("a later write failed"));
            }
            Ok::<_, Error>(value)
        }
    };
    let first = op.run(&store, &key, None, attempt(true)).await;
    assert!(first.is_err());
    let retry = op.run(&store, &key, None, attempt(false)).await;
    assert!(matches!(retry, Err(Error::Gone)), "{retry:?}");
    assert_eq!(measure.runs(), 1, "the step's effect ran once");
}
