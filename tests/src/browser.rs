//! The console in a real browser: the console served on a free local port, and headless
//! Chromium (Debian's `chromium` and `chromium-driver`) driven over WebDriver.

use std::net::SocketAddr;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

use fantoccini::{Client, ClientBuilder, Locator};
use outbox_runtime::console::{self, ConsoleSettings};
use sqlx::PgPool;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::ChildGuard;

/// A token long enough for the console.
pub const TOKEN: &str = "console-test-token-0123456789";

/// The console router on a free local port, until the test ends.
pub struct Served {
    pub addr: SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

impl Served {
    pub async fn start(pool: &PgPool, settings: ConsoleSettings) -> Served {
        Served::router(console::router(pool.clone(), settings).expect("console router")).await
    }

    /// Serves `app` (a console nested in an application's router, say).
    pub async fn router(app: axum::Router) -> Served {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().unwrap();
        let task = tokio::spawn(async move {
            axum::serve(listener, app).await.expect("serve the console");
        });
        Served { addr, task }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    /// One HTTP/1.1 request without a browser: its status and body.
    pub async fn request(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: &str,
    ) -> (u16, String) {
        let mut request = format!(
            "{method} {path} HTTP/1.1\r\nHost: {}\r\nConnection: close\r\nContent-Length: {}\r\n\
             Content-Type: application/x-www-form-urlencoded\r\n",
            self.addr,
            body.len()
        );
        for (name, value) in headers {
            request.push_str(&format!("{name}: {value}\r\n"));
        }
        request.push_str("\r\n");
        request.push_str(body);
        self.raw(&request).await
    }

    /// A request written out whole: its status and the whole response.
    pub async fn raw(&self, request: &str) -> (u16, String) {
        let mut stream = tokio::net::TcpStream::connect(self.addr)
            .await
            .expect("connect");
        stream.write_all(request.as_bytes()).await.expect("send");
        let mut response = Vec::new();
        stream.read_to_end(&mut response).await.expect("receive");
        let response = String::from_utf8_lossy(&response).into_owned();
        let status = response
            .split(' ')
            .nth(1)
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("not an HTTP response: {response}"));
        (status, response)
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Headless Chromium behind its own chromedriver, both gone when this is dropped.
pub struct Browser {
    pub client: Client,
    _driver: Group,
    profile: PathBuf,
}

/// chromedriver and the browsers it started: killed together when dropped, their profile
/// removed.
struct Group(ChildGuard);

impl Drop for Group {
    fn drop(&mut self) {
        let _ = Command::new("kill")
            .args(["-KILL", "--", &format!("-{}", self.0 .0.id())])
            .stderr(Stdio::null())
            .status();
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.profile);
    }
}

/// Where Debian puts chromedriver.
const CHROMEDRIVER: &str = "/usr/bin/chromedriver";
const CHROMIUM: &str = "/usr/bin/chromium";

impl Browser {
    pub async fn start() -> Browser {
        assert!(
            std::path::Path::new(CHROMEDRIVER).exists() && std::path::Path::new(CHROMIUM).exists(),
            "the browser tests need Debian's chromium and chromium-driver \
             (apt-get install chromium chromium-driver; .ci/run installs them)"
        );
        let port = free_port();
        // In a process group of its own, so that Chromium goes with it, also when a test
        // panics.
        let driver = Group(ChildGuard(
            Command::new(CHROMEDRIVER)
                .arg(format!("--port={port}"))
                .process_group(0)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("start chromedriver"),
        ));
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        while tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .is_err()
        {
            assert!(
                tokio::time::Instant::now() < deadline,
                "chromedriver did not start"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let profile =
            std::env::temp_dir().join(format!("outbox-chromium-{}", uuid::Uuid::new_v4()));
        let capabilities = serde_json::json!({
            "browserName": "chrome",
            // The tests answer the confirmation dialogs themselves.
            "unhandledPromptBehavior": "ignore",
            "goog:chromeOptions": {
                "binary": CHROMIUM,
                // What this machine's closed network needs, and a profile of its own.
                "args": [
                    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                    "--no-first-run", "--disable-background-networking",
                    "--disable-component-update", "--disable-sync",
                    "--window-size=1400,1000",
                    format!("--user-data-dir={}", profile.display()),
                ]
            }
        });
        let serde_json::Value::Object(capabilities) = capabilities else {
            unreachable!()
        };
        let connector = hyper_util::client::legacy::connect::HttpConnector::new();
        let client = ClientBuilder::new(connector)
            .capabilities(capabilities)
            .connect(&format!("http://127.0.0.1:{port}"))
            .await
            .expect("a WebDriver session in headless Chromium");
        Browser {
            client,
            _driver: driver,
            profile,
        }
    }

    /// The text of the first element `css` selects, waiting up to 10 s for it to appear.
    pub async fn text(&self, css: &str) -> String {
        self.client
            .wait()
            .at_most(Duration::from_secs(10))
            .for_element(Locator::Css(css))
            .await
            .unwrap_or_else(|e| panic!("no `{css}` on the page: {e}"))
            .text()
            .await
            .expect("text")
    }

    /// How many elements `css` selects now.
    pub async fn count(&self, css: &str) -> usize {
        self.client
            .find_all(Locator::Css(css))
            .await
            .expect("find")
            .len()
    }

    /// Waits (up to `timeout`) until `css` selects at least `n` elements; how many it selects.
    pub async fn wait_for_count(&self, css: &str, n: usize, timeout: Duration) -> usize {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let found = self.count(css).await;
            if found >= n {
                return found;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "`{css}` selects {found}, not {n}, after {timeout:?}; the page: {}",
                self.client.source().await.unwrap_or_default()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Waits (up to `timeout`) until `check` holds for the text of `css`.
    pub async fn wait_for_text(
        &self,
        css: &str,
        timeout: Duration,
        check: impl Fn(&str) -> bool,
    ) -> String {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let found = self.client.find(Locator::Css(css)).await;
            if let Ok(element) = found {
                if let Ok(text) = element.text().await {
                    if check(&text) {
                        return text;
                    }
                }
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "`{css}` never read as expected; the page: {}",
                self.client.source().await.unwrap_or_default()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Signs in with `token` on the console's sign-in page.
    pub async fn sign_in(&self, served: &Served, token: &str) {
        self.client
            .goto(&served.url("/login"))
            .await
            .expect("open /login");
        let field = self
            .client
            .find(Locator::Css("#token"))
            .await
            .expect("token field");
        field.send_keys(token).await.expect("type the token");
        field.send_keys("\u{E007}").await.expect("press Enter");
        self.client
            .wait()
            .at_most(Duration::from_secs(10))
            .for_element(Locator::Css("h1"))
            .await
            .expect("a page after signing in");
    }

    /// Runs `script` (a function body: `return ...;`) in the page; its value.
    pub async fn eval(&self, script: &str) -> serde_json::Value {
        self.client
            .execute(script, Vec::new())
            .await
            .unwrap_or_else(|e| panic!("the script failed: {e}\n{script}"))
    }

    /// Makes the page's viewport `width` CSS pixels wide (and `height` high): the window is
    /// resized by what its frame takes beside the viewport. Returns the viewport's width as
    /// the page measures it.
    pub async fn set_viewport(&self, width: u32, height: u32) -> u32 {
        let mut size = (width, height);
        for _ in 0..3 {
            self.client
                .set_window_size(size.0, size.1)
                .await
                .expect("resize the window");
            let inner = self
                .eval("return [window.innerWidth, window.innerHeight];")
                .await;
            let (w, h) = (
                inner[0].as_u64().unwrap() as u32,
                inner[1].as_u64().unwrap() as u32,
            );
            if (w, h) == (width, height) {
                // Laid out again at the new size: two frames later.
                self.client
                    .execute_async(
                        "const done = arguments[0]; \
                         requestAnimationFrame(() => requestAnimationFrame(() => done(null)));",
                        Vec::new(),
                    )
                    .await
                    .expect("wait for two frames");
                return w;
            }
            size = (
                size.0 + width - w.min(width),
                size.1 + height - h.min(height),
            );
        }
        self.eval("return window.innerWidth;")
            .await
            .as_u64()
            .unwrap() as u32
    }

    /// How many CSS pixels the page is wider than its viewport (0: no horizontal scroll), and
    /// the elements that reach past the viewport's right edge or their parent's content box,
    /// or whose content is wider than they are (and not clipped), by tag, id and class.
    pub async fn horizontal_overflow(&self) -> (i64, Vec<String>) {
        // Reading an element's box can lay out what Chromium had left for later (the content
        // of a closed `details`): measured until two readings agree.
        let mut last = self.overflow_once().await;
        for _ in 0..5 {
            let now = self.overflow_once().await;
            if now == last {
                break;
            }
            last = now;
        }
        last
    }

    async fn overflow_once(&self) -> (i64, Vec<String>) {
        let found = self
            .eval(
                "const root = document.documentElement;
                 const past = [];
                 for (const e of document.body.querySelectorAll('*')) {
                   const r = e.getBoundingClientRect();
                   const p = e.parentElement.getBoundingClientRect();
                   const inner = p.right - parseFloat(getComputedStyle(e.parentElement).paddingRight);
                   if (r.width > 0 && (r.right > root.clientWidth + 0.5 || r.right > inner + 0.5
                                       || e.scrollWidth > e.clientWidth + 1
                                          && getComputedStyle(e).overflowX !== 'hidden')) {
                     past.push(e.tagName.toLowerCase() + (e.id ? '#' + e.id : '')
                       + (e.className && typeof e.className === 'string'
                          ? '.' + e.className.trim().split(/\\s+/).join('.') : '')
                       + ' right ' + Math.round(r.right) + ', scrolls ' + (e.scrollWidth - e.clientWidth));
                   }
                 }
                 return [root.scrollWidth - root.clientWidth, past.slice(0, 20)];",
            )
            .await;
        let over = found[0].as_i64().unwrap();
        let past = found[1]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_str().unwrap().to_owned())
            .collect();
        (over, past)
    }

    /// The size of the page's HTML as the browser received it (bytes, decoded).
    pub async fn page_bytes(&self) -> u64 {
        self.eval("return performance.getEntriesByType('navigation')[0].decodedBodySize;")
            .await
            .as_u64()
            .expect("a navigation entry")
    }

    /// Saves a screenshot of the page as `target/console-screenshots/<name>.png`.
    pub async fn screenshot(&self, name: &str) -> PathBuf {
        let png = self.client.screenshot().await.expect("screenshot");
        let dir = screenshots_dir();
        std::fs::create_dir_all(&dir).expect("screenshot directory");
        let path = dir.join(format!("{name}.png"));
        std::fs::write(&path, png).expect("write the screenshot");
        path
    }

    /// Ends the WebDriver session (the processes and the profile go when this is dropped).
    pub async fn close(self) {
        let _ = self.client.clone().close().await;
    }
}

/// `target/console-screenshots`, in the workspace's target directory; or where
/// `OUTBOX_CONSOLE_SCREENSHOTS` says (a target directory shared by several checkouts).
pub fn screenshots_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("OUTBOX_CONSOLE_SCREENSHOTS") {
        return PathBuf::from(dir);
    }
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target"));
    target.join("console-screenshots")
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .expect("a free port")
        .local_addr()
        .unwrap()
        .port()
}

/// `1,152,021`: a figure as the console writes it.
pub fn thousands(n: i64) -> String {
    let digits = n.unsigned_abs().to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    if n < 0 {
        out.insert(0, '-');
    }
    out
}
