//! Key derivation: golden vectors pin the encoding across releases; hand-built encodings check
//! it against its documentation; properties check determinism, injectivity and map order.

use std::collections::{BTreeMap, HashMap};

use idem_runtime::{Error, Fingerprint, Key};
use proptest::prelude::*;
use serde::{Serialize, Serializer};
use sha2::{Digest, Sha256};

#[derive(Serialize)]
struct Order<'a> {
    id: u64,
    customer: &'a str,
}

#[derive(Serialize)]
struct OrderId(u64);

#[derive(Serialize)]
enum Event {
    Created,
    Paid(u32),
    Refunded { amount: u32, reason: &'static str },
    Moved(u8, u8),
}

/// Serializes through `serialize_bytes`, as `serde_bytes` does.
struct Raw(&'static [u8]);

impl Serialize for Raw {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_bytes(self.0)
    }
}

fn hex(key: &Key) -> String {
    key.to_hex()
}

fn golden() -> Vec<(&'static str, Key)> {
    let k = |ns: &str, v: &dyn erased::Value| v.key(ns);
    let map: BTreeMap<&str, u32> = [("b", 2), ("a", 1)].into();
    vec![
        ("u64 1", k("ns", &1_u64)),
        ("u8 0", k("ns", &0_u8)),
        ("i64 -1", k("ns", &-1_i64)),
        ("u128 max", k("ns", &u128::MAX)),
        ("i128 min", k("ns", &i128::MIN)),
        ("empty str", k("ns", &"")),
        ("str", k("ns", &"hello")),
        ("tuple ab,c", k("ns", &("ab", "c"))),
        ("tuple a,bc", k("ns", &("a", "bc"))),
        ("unit", k("ns", &())),
        ("true", k("ns", &true)),
        ("false", k("ns", &false)),
        ("none", k("ns", &None::<u8>)),
        ("some 0", k("ns", &Some(0_u8))),
        ("f64 1.5", k("ns", &1.5_f64)),
        ("f64 0", k("ns", &0.0_f64)),
        ("vec", k("ns", &vec![1_u32, 2, 3])),
        (
            "struct",
            k(
                "ns",
                &Order {
                    id: 42,
                    customer: "cus_7",
                },
            ),
        ),
        ("map", k("ns", &map)),
        ("unit variant", k("ns", &Event::Created)),
        ("newtype variant", k("ns", &Event::Paid(5))),
        (
            "struct variant",
            k(
                "ns",
                &Event::Refunded {
                    amount: 5,
                    reason: "dup",
                },
            ),
        ),
        ("tuple variant", k("ns", &Event::Moved(1, 2))),
        ("bytes", k("ns", &Raw(b"\x00\xff"))),
        ("char", k("", &'x')),
        ("charge", k("billing.charge.v1", &(42_u64, "cus_7"))),
        ("unicode namespace", k("billing/€", &1_u8)),
    ]
}

/// Lets the table hold values of many types.
mod erased {
    pub trait Value {
        fn key(&self, namespace: &str) -> idem_runtime::Key;
    }

    impl<T: serde::Serialize> Value for T {
        fn key(&self, namespace: &str) -> idem_runtime::Key {
            idem_runtime::Key::derive(namespace, self).expect("golden values encode")
        }
    }
}

const GOLDEN: &[(&str, &str)] = &[
    (
        "u64 1",
        "5cfea619cb9c59016f2a09bff7d05feba66c5eab326985f61e1af2e14d26bc78",
    ),
    (
        "u8 0",
        "50338fc287df41d10c5be6ea9bffb9822e3e1e1289193e39a5b75fe0ae03c3b5",
    ),
    (
        "i64 -1",
        "2ec20446b2f45522728f2bcfae17531294682f662a3358a42bedbd648a91f2be",
    ),
    (
        "u128 max",
        "565212fedc393426ec8d963f138a077c0b491e3823ffe355527bfc298b99e9b3",
    ),
    (
        "i128 min",
        "40032f0cd491a5f2c15e7f900adb7e08400fddf46f0cbdd97f5bb38a92f2d77e",
    ),
    (
        "empty str",
        "e8a887d5632be6c180d4fa44742c1950b70a06446c55def307373da95131cfbc",
    ),
    (
        "str",
        "e19ddec8ed55843be914f3f07c99661dc6e550761e9386803fc6e4e9870d191b",
    ),
    (
        "tuple ab,c",
        "2ae45bcb68f7faa2ed4c3f27c3e2ed5542b142c717bc07858ba06fc6ee8137f9",
    ),
    (
        "tuple a,bc",
        "512202cbe4b2be4a75764c81d48239aebd153421a7ea63c0d143dfed305208bc",
    ),
    (
        "unit",
        "b69453da961abfdff63417f97847371ef616eb9d95fd5be6686f1126fb6c21dd",
    ),
    (
        "true",
        "5f9390aab48a1fd1bceec206e73880ead776184dead1bf62c74411941e0d14c9",
    ),
    (
        "false",
        "d85f1c6a951b63d4b01dce72d7aba06a182e2c355cd8bcab9e9311466f7ea5a5",
    ),
    (
        "none",
        "24c2dbb68011070978b39e00921b1cf0242ae8f28016e9ac278edab5cfce4a91",
    ),
    (
        "some 0",
        "f0850ffbb9b898898e2e1b64c0b48d4a8bac3471db8258578ae024f77788d323",
    ),
    (
        "f64 1.5",
        "1ce1d206dc84da6e6a598396bca14601b21a0e45fe949de6170bb624b0093300",
    ),
    (
        "f64 0",
        "5bf2cf6b6b9a1aeb9254e481d1e06faee1a264a11c632b0bae329b76f525ffa6",
    ),
    (
        "vec",
        "51e3a78d65928016728446f8cf0d5c649914b5a6948efa9655a59bc55ea70dd4",
    ),
    (
        "struct",
        "97c6a4d6cd4dc07716252b32f41f0a91db5cccd3448acf6eccdc64db1ab07ba2",
    ),
    (
        "map",
        "2b73ca4cbe9a8b322184714891580f0f5ae5da8d389b3781b991a53208d43cf9",
    ),
    (
        "unit variant",
        "507a4f3f0a874ca9d986b02aab06e5bd14b9821730ce865b0cdfca6de14d74ae",
    ),
    (
        "newtype variant",
        "91cdc5448a8076077199c1db15ae025a59c098ba3838b0c911907a5c8b191b16",
    ),
    (
        "struct variant",
        "0f0bf5b9be3931f0672b623801f7576b1bb3e7de909767d870738b3342a95703",
    ),
    (
        "tuple variant",
        "b3122f40ecdcc3ccea47e12cd321acd001a6928faa3c590e7fbc8ed5073736bf",
    ),
    (
        "bytes",
        "7bc9ef64ce2c7440e40164a1a026ac208927bef94772a5a7dd7954bdd511b4ad",
    ),
    (
        "char",
        "0ff81bc9c672d191eab8d77f9fa7d0acb52c1389d916b25ee64ba3c4dc54659f",
    ),
    (
        "charge",
        "7fcabbd8800ab7649d51a202f0c3d98ba2c2b12d1f0b6be9a9627a085dd9337d",
    ),
    (
        "unicode namespace",
        "badf3d38f97d5e03194de35eccbf5c0efd413436bf7f6405cd104ee81d6be1f7",
    ),
];

#[test]
fn golden_vectors_are_stable() {
    let actual = golden();
    let mut mismatches = Vec::new();
    for (name, key) in &actual {
        let expected = GOLDEN.iter().find(|(n, _)| n == name).map(|(_, h)| *h);
        if expected != Some(hex(key).as_str()) {
            mismatches.push(format!("    (\"{name}\", \"{}\"),", hex(key)));
        }
    }
    assert!(
        mismatches.is_empty(),
        "key encoding changed (a breaking change: bump FORMAT_VERSION):\n{}",
        mismatches.join("\n")
    );
    assert_eq!(GOLDEN.len(), actual.len(), "every vector is pinned");
    assert!(GOLDEN.len() >= 20, "at least 20 vectors");
}

#[test]
fn golden_fingerprint_is_stable() {
    let fp = Fingerprint::of(&("4242", 1999_u32)).unwrap();
    assert_eq!(
        hex(&Key::from_bytes(*fp.as_bytes())),
        "736128f4907334e59309652d2bcbaf54a736fb966811387041847d8fdba6baac"
    );
}

/// The encoding, built by hand from the table in the `key` module's documentation.
fn by_hand(parts: &[&[u8]]) -> Key {
    let mut h = Sha256::new();
    for part in parts {
        h.update(part);
    }
    Key::from_bytes(h.finalize().into())
}

fn str_enc(s: &str) -> Vec<u8> {
    let mut v = vec![b's'];
    v.extend((s.len() as u64).to_le_bytes());
    v.extend(s.as_bytes());
    v
}

fn uint(n: u128) -> Vec<u8> {
    let mut v = vec![b'U'];
    v.extend(n.to_le_bytes());
    v
}

#[test]
fn encoding_matches_its_documentation() {
    let header: &[u8] = &[b'K', 1];
    assert_eq!(
        Key::derive("ns", &7_u8).unwrap(),
        by_hand(&[header, &str_enc("ns"), &uint(7)])
    );
    assert_eq!(
        Key::derive("ns", &("ab", "c")).unwrap(),
        by_hand(&[
            header,
            &str_enc("ns"),
            b"[",
            &str_enc("ab"),
            &str_enc("c"),
            b"]"
        ])
    );
    let mut neg = vec![b'I'];
    neg.extend((-3_i128).to_le_bytes());
    assert_eq!(
        Key::derive("ns", &Some(-3_i32)).unwrap(),
        by_hand(&[header, &str_enc("ns"), b"S", &neg])
    );
    assert_eq!(
        Key::derive(
            "ns",
            &Order {
                id: 1,
                customer: "c"
            }
        )
        .unwrap(),
        by_hand(&[
            header,
            &str_enc("ns"),
            b"{",
            &str_enc("id"),
            &uint(1),
            &str_enc("customer"),
            &str_enc("c"),
            b"}"
        ])
    );
    let fp_header: &[u8] = &[b'P', 1];
    assert_eq!(
        Key::from_bytes(*Fingerprint::of(&true).unwrap().as_bytes()),
        by_hand(&[fp_header, b"B\x01"])
    );
}

#[test]
fn boundaries_between_fields_are_unambiguous() {
    let a = Key::derive("ns", &("ab", "c")).unwrap();
    let b = Key::derive("ns", &("a", "bc")).unwrap();
    assert_ne!(a, b);
    // The namespace is length-prefixed too.
    assert_ne!(
        Key::derive("ns", &"x").unwrap(),
        Key::derive("n", &"sx").unwrap()
    );
    assert_ne!(
        Key::derive("ns", &vec![vec![1_u8], vec![]]).unwrap(),
        Key::derive("ns", &vec![vec![], vec![1_u8]]).unwrap()
    );
}

#[test]
fn integers_are_keyed_by_value_and_newtypes_are_transparent() {
    let k = Key::derive("ns", &42_u64).unwrap();
    assert_eq!(k, Key::derive("ns", &42_u32).unwrap());
    assert_eq!(k, Key::derive("ns", &42_i16).unwrap());
    assert_eq!(k, Key::derive("ns", &42_u128).unwrap());
    assert_eq!(k, Key::derive("ns", &OrderId(42)).unwrap());
    assert_ne!(k, Key::derive("ns", &-42_i64).unwrap());
    assert_ne!(k, Key::derive("ns", &42.0_f64).unwrap());
    assert_ne!(k, Key::derive("ns", &"42").unwrap());
    assert_eq!(
        Key::derive("ns", &'x').unwrap(),
        Key::derive("ns", &"x").unwrap()
    );
}

#[test]
fn floats_encode_by_value_and_nan_is_a_key_error() {
    assert_eq!(
        Key::derive("ns", &0.0_f64).unwrap(),
        Key::derive("ns", &-0.0_f64).unwrap()
    );
    assert_eq!(
        Key::derive("ns", &1.5_f32).unwrap(),
        Key::derive("ns", &1.5_f64).unwrap()
    );
    let err = Key::derive("ns", &(1_u8, f64::NAN)).unwrap_err();
    assert!(matches!(err, Error::Key(_)), "{err:?}");
    assert!(err.to_string().contains("NaN"), "{err}");
    assert!(matches!(Fingerprint::of(&f32::NAN), Err(Error::Key(_))));
}

#[test]
fn key_debug_and_display_never_show_the_value() {
    let key = Key::derive("ns", &"secret-card-number").unwrap();
    let shown = format!("{key:?} {key}");
    assert!(!shown.contains("secret"));
    assert_eq!(key.short().to_string().len(), 12);
    assert_eq!(key.to_hex().len(), 64);
}

proptest! {
    #[test]
    fn derivation_is_deterministic(ns in ".{0,12}", a in any::<u64>(), s in ".{0,24}") {
        prop_assert_eq!(Key::derive(&ns, &(a, &s)).unwrap(), Key::derive(&ns, &(a, s.clone())).unwrap());
    }

    #[test]
    fn splitting_a_string_differently_gives_another_key(joined in "[a-z]{0,16}", i in any::<prop::sample::Index>(), j in any::<prop::sample::Index>()) {
        let (i, j) = (i.index(joined.len() + 1), j.index(joined.len() + 1));
        prop_assume!(i != j);
        let (a, b) = joined.split_at(i);
        let (c, d) = joined.split_at(j);
        prop_assert_ne!(Key::derive("ns", &(a, b)).unwrap(), Key::derive("ns", &(c, d)).unwrap());
    }

    #[test]
    fn maps_ignore_insertion_order(entries in prop::collection::btree_map(".{0,8}", any::<i64>(), 0..16), seed in any::<u64>()) {
        let sorted = Key::derive("ns", &entries).unwrap();
        // HashMap iteration order is random per map; insert in a rotated order too.
        let mut pairs: Vec<_> = entries.iter().collect();
        if !pairs.is_empty() {
            let by = (seed as usize) % pairs.len();
            pairs.rotate_left(by);
        }
        let hashed: HashMap<_, _> = pairs.into_iter().collect();
        prop_assert_eq!(sorted, Key::derive("ns", &hashed).unwrap());
    }

    #[test]
    fn different_values_give_different_keys(a in any::<(u64, String)>(), b in any::<(u64, String)>()) {
        prop_assume!(a != b);
        prop_assert_ne!(Key::derive("ns", &a).unwrap(), Key::derive("ns", &b).unwrap());
    }
}
