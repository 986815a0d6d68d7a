//! The expansion uses absolute paths only: it compiles in a module without the prelude, where
//! `core` and `std` name local modules, and the generated locals collide with nothing.

mod no_prelude {
    #![no_implicit_prelude]
    #![deny(unused)]

    mod core {}
    mod std {}

    #[derive(Debug, PartialEq)]
    pub struct Failure;

    impl ::core::convert::From<::idem_runtime::Error> for Failure {
        fn from(_: ::idem_runtime::Error) -> Self {
            Failure
        }
    }

    pub struct Service {
        pub store: ::idem_runtime::MemoryStore,
    }

    impl Service {
        #[::idem_runtime::idempotent(key = id, store = self.store, namespace = "hygiene.method", fingerprint = id, in_flight = "reject", ttl = "1m", lease = "10s")]
        pub async fn method(&self, id: u64) -> ::core::result::Result<u64, Failure> {
            ::core::result::Result::Ok(id)
        }
    }

    #[derive(Debug, PartialEq, ::serde::Serialize, ::serde::Deserialize)]
    pub struct Declined(pub u8);

    impl ::core::convert::From<::idem_runtime::Error> for Declined {
        fn from(_: ::idem_runtime::Error) -> Self {
            Declined(0)
        }
    }

    fn is_final(_: &Declined) -> bool {
        true
    }

    // A parameter named like a generated local, and every argument at once.
    #[::idem_runtime::idempotent(key = (id, __idem_key), cache_err = is_final, on_cancel = "complete")]
    pub async fn function(id: u64, __idem_key: u8) -> ::core::result::Result<u64, Declined> {
        let _ = id;
        ::core::result::Result::Err(Declined(__idem_key))
    }
}

#[tokio::test]
async fn expansion_needs_no_prelude() {
    let service = no_prelude::Service {
        store: idem_runtime::MemoryStore::new(),
    };
    assert_eq!(service.method(3).await, Ok(3));
    assert_eq!(service.method(3).await, Ok(3));
    assert_eq!(
        no_prelude::function(1, 7).await,
        Err(no_prelude::Declined(7))
    );
    assert_eq!(
        no_prelude::function(1, 7).await,
        Err(no_prelude::Declined(7))
    );
}
