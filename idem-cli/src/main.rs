//! `idem`: operate an idem store from a shell (`cargo install idem-cli`; a feature per
//! store, all by default).
//!
//! ```text
//! idem --store postgres://u@h/db list --namespace billing. --state held
//! idem --store postgres://u@h/db show billing.charge.v1 '[17, "ada"]'
//! idem --store postgres://u@h/db release billing.charge.v1 '[17, "ada"]' --token 42
//! idem --store postgres://u@h/db show --webhook stripe evt_1NzF…   # by the sender's id
//! idem --store postgres://u@h/db show --http 4f1c… --scope alice  # by Idempotency-Key
//! idem --store 'dynamodb:?table=idem&region=eu-west-1' list --state held
//! idem key billing.charge.v1 '[17, "ada"]'
//! ```
//!
//! Everything it does goes through `idem_runtime::admin`, the API a program would use; the
//! operator's guide (`idem_runtime::guide::operations`) has the runbooks.

mod print;
mod stores;

use std::io::{BufRead, IsTerminal, Write};
use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};
use idem_runtime::admin::{self, Admin, Cursor, Entry, Filter, Refusal, Release, State, Verdict};
use idem_runtime::{Key, Token};

/// Why a command failed: the store's or the runtime's error, or the command line's own.
type Failure = Box<dyn std::error::Error + Send + Sync>;

fn failure(why: impl Into<String>) -> Failure {
    why.into().into()
}

/// What the exit status says, for scripts.
#[derive(Clone, Copy, Debug)]
enum Exit {
    /// Done (0).
    Done = 0,
    /// The store failed, or the input was wrong (1). Usage errors are clap's (2).
    Failed = 1,
    /// The store refused the release or reset, and changed nothing (3).
    Refused = 3,
    /// There is no record of the call (4).
    NotFound = 4,
    /// Not confirmed: nothing was done (5).
    NotConfirmed = 5,
}

#[derive(Parser, Debug)]
#[command(
    name = "idem",
    version,
    about = "See, release and reset the keys of an idem store, safely.",
    after_help = "Exit status: 0 done, 1 failed, 2 usage, 3 refused (nothing changed), 4 no such record, 5 not confirmed."
)]
struct Cli {
    /// The store's URL: postgres://…, mysql://…, sqlite:PATH (a table other than
    /// `idem_records` as `?table=NAME`); redis://…, redis+cluster://HOST:PORT,… or
    /// redis+sentinel://HOST:PORT,…/MASTER (a key prefix other than `idem:` as
    /// `?prefix=PREFIX`); dynamodb:?table=NAME&region=REGION&endpoint=URL (each optional:
    /// `idem_records`, AWS_REGION, AWS's endpoint; credentials from AWS_ACCESS_KEY_ID,
    /// AWS_SECRET_ACCESS_KEY and AWS_SESSION_TOKEN).
    #[arg(long, env = "IDEM_STORE", global = true, hide_env_values = true)]
    store: Option<String>,
    /// The fast tier in front of the store, when the service runs a `TieredStore` whose
    /// fast tier is shared (redis://…): a reset then forgets its copy there too. (A
    /// per-process fast tier over PostgreSQL forgets it by itself, told by the server.)
    #[arg(long, env = "IDEM_FAST_STORE", global = true, hide_env_values = true)]
    fast: Option<String>,
    /// Prints JSON for scripts instead of a table for people.
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Lists records, a page at a time, in key order (Redis: in SCAN's order), never their
    /// values.
    List {
        /// Only records whose namespace starts with this.
        #[arg(long)]
        namespace: Option<String>,
        /// Only records in these states (repeat it); all states by default.
        #[arg(long, value_enum)]
        state: Vec<StateArg>,
        /// Only records labelled exactly this (a webhook preset labels its claims with the
        /// delivery's id).
        #[arg(long)]
        label: Option<String>,
        /// Records a page (at most 1000).
        #[arg(long, default_value_t = 100)]
        limit: usize,
        /// Where the page starts: the `next` cursor a page printed.
        #[arg(long)]
        after: Option<String>,
        /// Every page, one after the other, instead of the first.
        #[arg(long)]
        all: bool,
    },
    /// Shows one call: its claim or result, its value and its steps.
    Show {
        #[command(flatten)]
        call: CallArgs,
    },
    /// Releases a claim whose holder is silent (or, with --force, any; the holder is
    /// fenced), so that the next call runs at once.
    Release {
        #[command(flatten)]
        call: CallArgs,
        /// The claim's token, as `list` or `show` printed it.
        #[arg(long)]
        token: u64,
        /// Releases a live holder too, and fences it.
        #[arg(long)]
        force: bool,
        /// Does it without asking.
        #[arg(long)]
        yes: bool,
    },
    /// Forgets a completed call and its steps, so that its next call runs again.
    Reset {
        #[command(flatten)]
        call: CallArgs,
        /// Forgets a call in progress too, fencing its holder.
        #[arg(long)]
        force: bool,
        /// Does it without asking.
        #[arg(long)]
        yes: bool,
    },
    /// Deletes the expired records.
    Purge {
        /// Does it without asking.
        #[arg(long)]
        yes: bool,
    },
    /// Prints the digest the macro derives for a key value in a namespace (no store).
    Key {
        namespace: String,
        /// The key value as JSON: `17`, `"ord_1"`, `[17, "ada"]` for a key of two arguments.
        #[arg(allow_negative_numbers = true, value_name = "KEY_JSON")]
        value: String,
    },
}

/// How a command names one call.
#[derive(clap::Args, Debug)]
struct CallArgs {
    /// The call: its NAMESPACE and key value as JSON (`'[17, "ada"]'`), its NAMESPACE and
    /// 64-digit digest, or its digest alone; with --webhook, the delivery's id as its
    /// sender names it; with --http, the request's Idempotency-Key.
    #[arg(num_args = 1..=2, required = true, allow_negative_numbers = true, value_names = ["NAMESPACE", "KEY_JSON"])]
    call: Vec<String>,
    /// The call is a webhook delivery of this sender's preset, named by its id (Stripe's
    /// event id, X-GitHub-Delivery, X-Shopify-Webhook-Id, webhook-id or svix-id): found
    /// by the label the presets write.
    #[arg(long, value_enum, conflicts_with = "http")]
    webhook: Option<SenderArg>,
    /// With --webhook: the receiving endpoint's name (every endpoint of the sender by
    /// default).
    #[arg(long, requires = "webhook")]
    endpoint: Option<String>,
    /// The call is a request through an HTTP layer, named by its Idempotency-Key.
    #[arg(long)]
    http: bool,
    /// With --http: the principal the layer's scope named (none for an unscoped layer).
    #[arg(long, requires = "http")]
    scope: Option<String>,
    /// With --http: the layer's namespace.
    #[arg(long, requires = "http", default_value = "idem.http")]
    namespace: String,
}

/// The senders with a webhook preset.
#[derive(Clone, Copy, Debug, ValueEnum)]
enum SenderArg {
    Stripe,
    Github,
    Shopify,
    Standard,
}

impl SenderArg {
    fn name(self) -> &'static str {
        match self {
            Self::Stripe => "stripe",
            Self::Github => "github",
            Self::Shopify => "shopify",
            Self::Standard => "standard",
        }
    }
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum StateArg {
    Held,
    Lapsed,
    Completed,
    Gone,
}

impl From<StateArg> for State {
    fn from(state: StateArg) -> Self {
        match state {
            StateArg::Held => State::Held,
            StateArg::Lapsed => State::Lapsed,
            StateArg::Completed => State::Completed,
            StateArg::Gone => State::Gone,
        }
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let secrets: Vec<String> = [cli.store.as_deref(), cli.fast.as_deref()]
        .into_iter()
        .flatten()
        .flat_map(stores::passwords)
        .collect();
    let redacted = |text: String| {
        secrets
            .iter()
            .fold(text, |text, secret| text.replace(secret.as_str(), "***"))
    };
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(err) => {
            eprintln!("idem: cannot start: {err}");
            return ExitCode::from(Exit::Failed as u8);
        }
    };
    let exit = match runtime.block_on(run(cli)) {
        Ok(exit) => exit,
        Err(err) => {
            // The runtime's own words for a bad input, without its "configuration" prefix.
            // Never the store's password, whatever the error quotes of its URL.
            let why = match err.downcast_ref::<idem_runtime::Error>() {
                Some(idem_runtime::Error::Config(why)) => why.to_string(),
                _ => err.to_string(),
            };
            eprintln!("idem: {}", redacted(why));
            Exit::Failed
        }
    };
    ExitCode::from(exit as u8)
}

async fn run(cli: Cli) -> Result<Exit, Failure> {
    let json = cli.json;
    if let Command::Key { namespace, value } = &cli.command {
        let key = admin::key_from_json(namespace, value)?;
        print::key(&key, json);
        return Ok(Exit::Done);
    }
    let Some(url) = cli.store.as_deref() else {
        return Err(failure(
            "which store? give its URL with --store (or IDEM_STORE)",
        ));
    };
    let store = stores::open(url, cli.fast.as_deref()).await?;
    match cli.command {
        Command::Key { .. } => unreachable!("answered above"),
        Command::List {
            namespace,
            state,
            label,
            limit,
            after,
            all,
        } => {
            let mut filter = match namespace {
                Some(prefix) => Filter::namespace(prefix),
                None => Filter::all(),
            };
            if let Some(label) = label {
                filter = filter.label(label);
            }
            for state in state {
                filter = filter.state(state.into());
            }
            let filter = filter.limit(limit.clamp(1, admin::MAX_PAGE));
            let mut cursor = after.as_deref().map(str::parse::<Cursor>).transpose()?;
            let mut first = true;
            loop {
                let page = store.list(&filter, cursor.as_ref()).await?;
                // A page the filter left empty (a store reads a bounded stretch of keys a
                // call) is not shown: the listing goes on to the next one.
                let empty = page.entries().is_empty();
                if !empty || page.next().is_none() {
                    print::page(&page, json, first);
                    first = false;
                }
                match page.next() {
                    Some(next) if all || empty => cursor = Some(next),
                    _ => return Ok(Exit::Done),
                }
            }
        }
        Command::Show { call } => {
            let keys = match named(&*store, &call).await? {
                Named::Key(key) => vec![key],
                Named::Found(keys) => keys,
                Named::Missing(what) => {
                    print::none(&what, json);
                    return Ok(Exit::NotFound);
                }
            };
            let mut shown = 0;
            for key in &keys {
                match store.inspect(key).await? {
                    Some(entry) => {
                        check_namespace(&call, &entry)?;
                        print::entry(&entry, json);
                        shown += 1;
                    }
                    None if keys.len() == 1 => print::missing(key, json),
                    None => {}
                }
            }
            Ok(if shown == 0 {
                Exit::NotFound
            } else {
                Exit::Done
            })
        }
        Command::Release {
            call,
            token,
            force,
            yes,
        } => {
            let Some((key, entry)) = one(&*store, &call, json).await? else {
                return Ok(Exit::NotFound);
            };
            let how = release_how(force);
            if !confirmed(yes, &format!("release {}", describe(&entry)))? {
                return Ok(Exit::NotConfirmed);
            }
            let verdict = Admin::release(&*store, &key, Token::new(token), how).await?;
            Ok(report(&key, "released", verdict, json))
        }
        Command::Reset { call, force, yes } => {
            let Some((key, entry)) = one(&*store, &call, json).await? else {
                return Ok(Exit::NotFound);
            };
            let how = release_how(force);
            if !confirmed(yes, &format!("forget {}", describe(&entry)))? {
                return Ok(Exit::NotConfirmed);
            }
            let verdict = store.reset(&key, how).await?;
            Ok(report(&key, "reset", verdict, json))
        }
        Command::Purge { yes } => {
            if !confirmed(yes, "delete every expired record")? {
                return Ok(Exit::NotConfirmed);
            }
            let purged = store.purge().await?;
            print::purged(purged, json);
            Ok(Exit::Done)
        }
    }
}

/// What a command's call names.
enum Named {
    /// One key, derived or given.
    Key(Key),
    /// The keys a label search found (several endpoints may have a delivery of one id).
    Found(Vec<Key>),
    /// Nothing: what was looked for, in words.
    Missing(String),
}

/// The call `call` names: by its digest, its namespace and key value as JSON (or digest),
/// a webhook delivery's id (the presets' label), or an HTTP request's Idempotency-Key.
async fn named(store: &dyn Admin, call: &CallArgs) -> Result<Named, Failure> {
    if let Some(sender) = call.webhook {
        let [id] = call.call.as_slice() else {
            return Err(failure("--webhook names a delivery by its id alone"));
        };
        let prefix = match &call.endpoint {
            Some(endpoint) => format!("idem.webhook.{}.{endpoint}", sender.name()),
            None => format!("idem.webhook.{}.", sender.name()),
        };
        let filter = Filter::namespace(prefix.clone())
            .label(id.clone())
            .limit(admin::MAX_PAGE);
        let mut keys = Vec::new();
        let mut cursor = None;
        loop {
            let page = store.list(&filter, cursor.as_ref()).await?;
            keys.extend(
                page.entries()
                    .iter()
                    // A named endpoint is that namespace exactly, not another it begins.
                    .filter(|entry| {
                        call.endpoint.is_none() || entry.namespace() == Some(prefix.as_str())
                    })
                    .map(|entry| *entry.key()),
            );
            match page.next() {
                Some(next) => cursor = Some(next),
                None => break,
            }
        }
        return Ok(if keys.is_empty() {
            Named::Missing(format!("no {} delivery {id} under {prefix}", sender.name()))
        } else {
            Named::Found(keys)
        });
    }
    if call.http {
        let [key] = call.call.as_slice() else {
            return Err(failure(
                "--http names a request by its Idempotency-Key alone",
            ));
        };
        return Ok(Named::Key(admin::http_key(
            &call.namespace,
            call.scope.as_deref(),
            key,
        )?));
    }
    Ok(Named::Key(match call.call.as_slice() {
        [digest] => admin::parse_digest(digest)?,
        [_, digest] if is_digest(digest) => admin::parse_digest(digest)?,
        [namespace, json] => admin::key_from_json(namespace, json)?,
        _ => {
            return Err(failure(
                "name the call by NAMESPACE KEY_JSON, NAMESPACE DIGEST or DIGEST",
            ))
        }
    }))
}

/// Whether `text` is a key's 64 hex digits (which no JSON key value is but a 64-digit
/// number, which no key of 64 bits can be).
fn is_digest(text: &str) -> bool {
    let text = text.trim();
    text.len() == 64 && text.bytes().all(|b| b.is_ascii_hexdigit())
}

/// A call named by NAMESPACE and DIGEST is refused when its record says another namespace.
fn check_namespace(call: &CallArgs, entry: &Entry) -> Result<(), Failure> {
    if call.webhook.is_some() || call.http {
        return Ok(());
    }
    if let ([namespace, digest], Some(recorded)) = (call.call.as_slice(), entry.namespace()) {
        if is_digest(digest) && recorded != namespace {
            return Err(failure(format!(
                "the record {} is of namespace {recorded}, not {namespace}",
                entry.key().to_hex()
            )));
        }
    }
    Ok(())
}

/// The one call a release or a reset acts on, and its entry; `None` (printed) when there
/// is none. Several (a delivery id found under several endpoints) is refused: name the
/// endpoint, or the call by its digest.
async fn one(
    store: &dyn Admin,
    call: &CallArgs,
    json: bool,
) -> Result<Option<(Key, Entry)>, Failure> {
    let key = match named(store, call).await? {
        Named::Key(key) => key,
        Named::Found(keys) if keys.len() == 1 => keys[0],
        Named::Found(keys) => {
            let keys: Vec<String> = keys.iter().map(Key::to_hex).collect();
            return Err(failure(format!(
                "{} calls have that id (one per endpoint): name the endpoint with --endpoint, or the call by its digest: {}",
                keys.len(),
                keys.join(", ")
            )));
        }
        Named::Missing(what) => {
            print::none(&what, json);
            return Ok(None);
        }
    };
    let Some(entry) = store.inspect(&key).await? else {
        print::missing(&key, json);
        return Ok(None);
    };
    check_namespace(call, &entry)?;
    Ok(Some((key, entry)))
}

/// One line that says what is about to be changed.
fn describe(entry: &Entry) -> String {
    let namespace = entry.namespace().unwrap_or("namespace unknown");
    let mut line = format!("{} {} ({})", namespace, entry.key().to_hex(), entry.state());
    if let Some(label) = entry.label() {
        line.push_str(&format!(", labelled {label}"));
    }
    if let Some(holder) = entry.holder() {
        line.push_str(&format!(", held by {holder}"));
    }
    line
}

/// Whether to go on: told `--yes`, or answered `y` at the prompt. Without a terminal to
/// ask on, and without `--yes`, nothing is done.
fn confirmed(yes: bool, what: &str) -> Result<bool, Failure> {
    if yes {
        return Ok(true);
    }
    let stdin = std::io::stdin();
    if !stdin.is_terminal() {
        eprintln!("idem: not confirmed: {what}? Pass --yes to do it without a prompt.");
        return Ok(false);
    }
    eprint!("{what}? [y/N] ");
    let _ = std::io::stderr().flush();
    let mut answer = String::new();
    stdin
        .lock()
        .read_line(&mut answer)
        .map_err(|err| failure(format!("cannot read the answer: {err}")))?;
    let yes = matches!(answer.trim(), "y" | "Y" | "yes");
    if !yes {
        eprintln!("idem: not confirmed; nothing was done");
    }
    Ok(yes)
}

/// Prints what a release or reset did; its exit status.
fn report(key: &Key, done: &str, verdict: Verdict, json: bool) -> Exit {
    print::verdict(key, done, &verdict, json);
    match verdict {
        Verdict::Done => Exit::Done,
        Verdict::Refused(Refusal::NotFound) => Exit::NotFound,
        Verdict::Refused(_) => Exit::Refused,
        _ => Exit::Refused,
    }
}

/// How a release or reset treats a live holder: by force only when `--force` says so.
fn release_how(force: bool) -> Release {
    if force {
        Release::Force
    } else {
        Release::IfSilent
    }
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    #[test]
    fn the_command_line_is_well_formed() {
        super::Cli::command().debug_assert();
    }
}
