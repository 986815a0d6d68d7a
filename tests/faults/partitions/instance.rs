//! The application instance: a test of this binary, ignored, run by the scenarios in a host
//! of its own and driven over its standard input.

use super::*;

/// An application instance, run by the scenarios in a host of its own. It reads
/// instructions on its stdin: `run <key> <hold|go> <ms>` starts a call whose body prints
/// `claimed <key> <token>`, waits for `finish <key>` (hold), pauses `ms`, writes downstream
/// with its fencing token and prints `wrote <key> <token> <landed|refused>`; the call prints
/// `outcome <key> <executed|replayed> <by> <token>` or `outcome <key> failed <error>`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "an application instance: started by the partition tests in a host of its own"]
async fn instance() {
    let (Ok(url), Ok(downstream), Ok(name)) = (
        std::env::var(STORE_VAR),
        std::env::var(DOWNSTREAM_VAR),
        std::env::var(NAME_VAR),
    ) else {
        println!("started alone: the partition tests run this in a host of its own");
        return;
    };
    let store = store(&url).await.unwrap();
    let op = Operation::new(NAMESPACE)
        .lease(LEASE)
        .wait(Duration::from_secs(60));
    let by = name.chars().next().unwrap();
    let mut held = HashMap::new();
    let mut calls = tokio::task::JoinSet::new();
    let mut lines = BufReader::new(tokio::io::stdin()).lines();
    println!("ready");
    while let Some(line) = lines.next_line().await.unwrap() {
        let words: Vec<&str> = line.split(' ').collect();
        match words[..] {
            ["run", key, hold, pause] => {
                let finish = (hold == "hold").then(|| {
                    let (finish, finished) = tokio::sync::oneshot::channel();
                    held.insert(key.to_string(), finish);
                    finished
                });
                let pause = Duration::from_millis(pause.parse().unwrap());
                let (op, store, downstream) = (op.clone(), store.clone(), downstream.clone());
                let key = key.to_string();
                calls.spawn(async move {
                    let body = async {
                        let token = attempt().expect("in the body").token().await?;
                        println!("claimed {key} {}", token.get());
                        if let Some(finish) = finish {
                            let _ = finish.await;
                        }
                        tokio::time::sleep(pause).await;
                        let landed = write(&downstream, &key, token, by).await;
                        let answer = if landed { "landed" } else { "refused" };
                        println!("wrote {key} {} {answer}", token.get());
                        Ok::<_, Error>(Written {
                            by,
                            token: token.get(),
                        })
                    };
                    let outcome = op.run(&store, &op.key(&key).unwrap(), None, body).await;
                    match outcome {
                        Ok(Outcome::Executed(w)) => {
                            println!("outcome {key} executed {} {}", w.by, w.token)
                        }
                        Ok(Outcome::Replayed(w)) => {
                            println!("outcome {key} replayed {} {}", w.by, w.token)
                        }
                        Err(e) => println!("outcome {key} failed {}", one_line(&e)),
                    }
                });
            }
            ["finish", key] => {
                // A call whose claim failed never started its body: nothing to finish.
                let _ = held.remove(key).expect("a held call").send(());
            }
            _ => panic!("an instruction this instance does not know: {line:?}"),
        }
    }
    while calls.join_next().await.is_some() {}
}

fn one_line(e: &Error) -> String {
    e.to_string().replace('\n', " ")
}

/// One fenced write downstream: whether it landed.
async fn write(downstream: &str, key: &str, token: Token, by: char) -> bool {
    let socket = tokio::net::TcpStream::connect(downstream)
        .await
        .expect("the downstream is never cut off");
    let (read, mut write) = socket.into_split();
    write
        .write_all(format!("{key} {} {by}\n", token.get()).as_bytes())
        .await
        .unwrap();
    let answer = BufReader::new(read).lines().next_line().await.unwrap();
    answer.as_deref() == Some("landed")
}
