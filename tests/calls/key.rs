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
        "4f742a96c86e65f3a5478c1ea386dffbebfe52f31221f076cdbd6a58860772bc",
    ),
    (
        "u8 0",
        "cde01e2bcfa37d0826d9eb2c2bf9d1ee3af9375cbbdfa1b65488707ac6474a07",
    ),
    (
        "i64 -1",
        "b0644fd5d0e486580cd4b579aadf4e82bf8eee1e15633b67f690262cfd46f076",
    ),
    (
        "u128 max",
        "2a3e36875d0d2f3ea9f0ffa4d007519d990d466dadf7fb8b4fc8e8ff8da80562",
    ),
    (
        "i128 min",
        "544dc99f1e15b707cb070a2f205b7bf8627ee37019ba98f9d0c4d274e4b44953",
    ),
    (
        "empty str",
        "259d3f9f38dac490fc6cbdbbb91b93dde97bcf43a4c4d5be1db3871ba2d2bb35",
    ),
    (
        "str",
        "928677ceb07b0c27be8841ba0007eaad5e36f78a4772258ca077efc816444101",
    ),
    (
        "tuple ab,c",
        "49b5f1749a33f0806cb2160b209c8dd2a3ebe95ed07b7f6673fddbcbf46de21f",
    ),
    (
        "tuple a,bc",
        "bfc9f84fbe289966b48cceac979401deaae2168d234abd1d0d8cbe6b64d5aa89",
    ),
    (
        "unit",
        "5272b8fbf0dadf787321603640f1e74e228142de56964924553dae393d7e63e3",
    ),
    (
        "true",
        "a88d9d909af6d4935937548bc3fd66bf55be4b8246f84b3e6b1bd93c79246df1",
    ),
    (
        "false",
        "c4e1c8bfb2939172245c7491b8a20e15bbf9ab9f1e4eb58c332fb4656084c1d3",
    ),
    (
        "none",
        "5b1c3eb44d1ec27fde6dadb5855fca6c4877e81597311da14b99bbdcb930bc0f",
    ),
    (
        "some 0",
        "4a8a5f5368660ef247c958683b1917d21304ac7235e70bd124dd254aa1f5bd84",
    ),
    (
        "f64 1.5",
        "6bb513ea60fd5024cb476f0fcbe2fd9bb27d7c3b6ac3a933512bc8d3740a5468",
    ),
    (
        "f64 0",
        "a394b6886bc6c131f5a796fc25b061735685631d8b8390250335e46a409a3a16",
    ),
    (
        "vec",
        "a5ad4456ca98566f96b7271e8bd3c8eaee918ebda8e37285f14819870e54d1eb",
    ),
    (
        "struct",
        "26e357772dcf6f552ecfbb5fb460e775b0ec5bc0b6d2c2944dad812ca16b44ed",
    ),
    (
        "map",
        "595e2e46d149fa459655edd1ba4c34b3fb7619b039d6cb29f93ae94389864917",
    ),
    (
        "unit variant",
        "1af877c797835714751a5b669491837ba44fb2b31568e84ff186c1e5a6945fd7",
    ),
    (
        "newtype variant",
        "ee3e51d5dc90c295f8c9d4712ca6389bd2c6ddbdb2dbbc901db1c5cbe94bf45b",
    ),
    (
        "struct variant",
        "a26ceb056bed24306645920ef2515c1e431d944b25b72dae278fd25f834d3a77",
    ),
    (
        "tuple variant",
        "74c238c0599e546b19afe2a73619ae183d9c41ec4766e355b2ba95d11ae0e97c",
    ),
    (
        "bytes",
        "c31e739719497ec8756cf38c66dd206ccf6c4ebde9d4807388879eaa187e6990",
    ),
    (
        "char",
        "be6e483bcc83c463422b263680e8d381973905175107da3685022ae1675b4b16",
    ),
    (
        "charge",
        "d26fa06718521f0dc51a5a93646bc22804ba4b225c3cd683c6ec58572252c65c",
    ),
    (
        "unicode namespace",
        "76ade12984850b32f4def9e7a2e600a6cbc9c102559438ea83aa8e60598a5d0b",
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
        "840bd423af06f4c790aab5c45d1d3ec7dbf66cfc56b23425f6912a63e1c6109c"
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

/// Unsigned LEB128, written out independently of the runtime's.
fn leb128(mut n: u128) -> Vec<u8> {
    let mut out = Vec::new();
    loop {
        let byte = (n % 128) as u8;
        n /= 128;
        if n == 0 {
            out.push(byte);
            return out;
        }
        out.push(byte + 128);
    }
}

fn str_enc(s: &str) -> Vec<u8> {
    let mut v = vec![b's'];
    v.extend(leb128(s.len() as u128));
    v.extend(s.as_bytes());
    v
}

fn uint(n: u128) -> Vec<u8> {
    let mut v = vec![b'U'];
    v.extend(leb128(n));
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
    neg.extend(leb128(2)); // -(-3 + 1)
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
    // Multi-byte LEB128: 300 = 0b10_0101100 -> [0xAC, 0x02]; a long string's length too.
    assert_eq!(leb128(300), vec![0xAC, 0x02]);
    assert_eq!(
        Key::derive("ns", &300_u16).unwrap(),
        by_hand(&[header, &str_enc("ns"), b"U\xAC\x02"])
    );
    let long = "x".repeat(200);
    assert_eq!(
        Key::derive("ns", &long).unwrap(),
        by_hand(&[header, &str_enc("ns"), &str_enc(&long)])
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

    /// The encoder gathers bytes in a block-sized buffer and writes integers up to 64 bits
    /// in 64-bit arithmetic: whatever the lengths and values, and wherever a field crosses
    /// the buffer's end, the bytes hashed are the documented ones.
    #[test]
    fn any_fields_encode_as_documented(
        ns in ".{0,40}",
        fields in prop::collection::vec((any::<i64>(), ".{0,90}", any::<u64>(), any::<i8>()), 0..6),
    ) {
        let mut parts: Vec<Vec<u8>> = vec![vec![b'K', 1], str_enc(&ns), b"[".to_vec()];
        for (signed, text, unsigned, small) in &fields {
            parts.push(b"[".to_vec());
            for n in [i128::from(*signed), i128::from(*small)] {
                parts.push(if n < 0 {
                    let mut v = vec![b'I'];
                    v.extend(leb128((-(n + 1)) as u128));
                    v
                } else {
                    uint(n as u128)
                });
            }
            parts.push(str_enc(text));
            parts.push(uint(u128::from(*unsigned)));
            parts.push(b"]".to_vec());
        }
        parts.push(b"]".to_vec());
        let parts: Vec<&[u8]> = parts.iter().map(Vec::as_slice).collect();
        let values: Vec<_> = fields.iter().map(|(a, b, c, d)| (a, d, b, c)).collect();
        prop_assert_eq!(Key::derive(&ns, &values).unwrap(), by_hand(&parts));
    }

    #[test]
    fn different_values_give_different_keys(a in any::<(u64, String)>(), b in any::<(u64, String)>()) {
        prop_assume!(a != b);
        prop_assert_ne!(Key::derive("ns", &a).unwrap(), Key::derive("ns", &b).unwrap());
    }
}
