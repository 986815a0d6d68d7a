//! The network: a proxy that loses answers, refuses, cuts and stalls.

use super::*;

#[derive(Clone, Copy, PartialEq, Eq)]
enum Fault {
    None,
    /// The request is processed; its answer is thrown away and the connection closed.
    LoseAnswer,
    /// Closed before anything is forwarded.
    Refuse,
    /// Part of the request is forwarded, then both sides are closed.
    CutRequest,
    /// The request is processed; the answer never comes.
    Stall,
}

/// A deterministic draw for number `n` (splitmix64).
pub(super) fn draw(n: u64) -> u64 {
    let mut z = n.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn fault(connection: u64) -> Fault {
    match draw(connection) % 100 {
        0..=69 => Fault::None,
        70..=79 => Fault::LoseAnswer,
        80..=87 => Fault::Refuse,
        88..=94 => Fault::CutRequest,
        _ => Fault::Stall,
    }
}

pub(super) async fn proxy(upstream: SocketAddr) -> Result<SocketAddr, BoxError> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let address = listener.local_addr()?;
    tokio::spawn(async move {
        for connection in 0_u64.. {
            let Ok((client, _)) = listener.accept().await else {
                continue;
            };
            tokio::spawn(relay(client, upstream, fault(connection)));
        }
    });
    Ok(address)
}

async fn relay(mut client: TcpStream, upstream: SocketAddr, fault: Fault) {
    if fault == Fault::Refuse {
        return;
    }
    // The service may be down (killed): the client then sees its connection closed.
    let Ok(mut server) = TcpStream::connect(upstream).await else {
        return;
    };
    if fault == Fault::CutRequest {
        let mut start = [0; 24];
        if let Ok(read) = client.read(&mut start).await {
            let _ = server.write_all(&start[..read]).await;
        }
        return;
    }
    let (mut client_read, mut client_write) = client.into_split();
    let (mut server_read, mut server_write) = server.into_split();
    let upward = tokio::spawn(async move {
        let _ = tokio::io::copy(&mut client_read, &mut server_write).await;
    });
    let mut answer = vec![0; 64 * 1024];
    while let Ok(read @ 1..) = server_read.read(&mut answer).await {
        match fault {
            Fault::LoseAnswer => break,
            Fault::Stall => {
                let _ = upward.await;
                return;
            }
            _ => {}
        }
        if client_write.write_all(&answer[..read]).await.is_err() {
            break;
        }
    }
    upward.abort();
}
