//! The raw socket on the real kernel: frames between the two ends of a veth
//! pair in a fresh network namespace (root). Without root the test prints
//! why it skips, or fails when `FLATNET_REQUIRE_PRIVILEGED` is set.

use std::{fs::File, os::fd::AsRawFd, process::Command, thread, time::Duration};

use flatnet_packet_socket::{RawSocket, Receive, Received};

/// An EtherType reserved for local experiments (IEEE 802): nothing else on
/// the pair sends it, so a silent socket stays silent.
const LOCAL_EXPERIMENTAL: u16 = 0x88b5;
const WAIT: Duration = Duration::from_secs(2);

fn privileged(test: &str) -> bool {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        return true;
    }
    let reason = "needs root (network namespaces, raw sockets)";
    assert!(
        std::env::var_os("FLATNET_REQUIRE_PRIVILEGED").is_none(),
        "{test}: {reason}, and FLATNET_REQUIRE_PRIVILEGED is set"
    );
    use std::io::Write as _;
    let _ = writeln!(std::io::stderr(), "skipped: {test}: {reason}");
    false
}

fn ip(args: &[&str]) {
    let out = Command::new("ip").args(args).output().expect("run ip");
    assert!(
        out.status.success(),
        "ip {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A named namespace holding the veth pair `veth0` / `veth1`, deleted on drop.
struct Pair {
    netns: String,
}

impl Pair {
    fn new() -> Self {
        let netns = format!("fpsock{}", std::process::id());
        ip(&["netns", "add", &netns]);
        let pair = Self { netns };
        let add = "link add name veth0 type veth peer name veth1";
        ip(&[
            &["-n", &pair.netns][..],
            &add.split(' ').collect::<Vec<_>>(),
        ]
        .concat());
        for end in ["veth0", "veth1"] {
            ip(&["-n", &pair.netns, "link", "set", end, "up"]);
        }
        pair
    }

    /// Runs `work` on a thread inside the namespace.
    fn run<T: Send + 'static>(&self, work: impl FnOnce() -> T + Send + 'static) -> T {
        let netns = File::open(format!("/run/netns/{}", self.netns)).expect("open netns");
        thread::spawn(move || {
            // SAFETY: a valid namespace descriptor; only this thread moves.
            let entered = unsafe { libc::setns(netns.as_raw_fd(), libc::CLONE_NEWNET) };
            assert_eq!(entered, 0, "setns: {}", std::io::Error::last_os_error());
            work()
        })
        .join()
        .expect("namespace thread")
    }
}

impl Drop for Pair {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["netns", "delete", &self.netns])
            .status();
    }
}

fn frame(payload: &[u8]) -> Vec<u8> {
    let mut frame = vec![0x02, 0, 0, 0, 0, 0x0b, 0x02, 0, 0, 0, 0, 0x0a];
    frame.extend_from_slice(&LOCAL_EXPERIMENTAL.to_be_bytes());
    frame.extend_from_slice(payload);
    frame.resize(60, 0);
    frame
}

/// The next frame on `socket` carrying `payload`, skipping others.
fn wait_for(socket: &RawSocket, payload: &[u8]) -> Option<(Vec<u8>, Received)> {
    let mut buffer = [0u8; 2048];
    let deadline = std::time::Instant::now() + WAIT;
    while std::time::Instant::now() < deadline {
        if let Some(received) = socket.receive(&mut buffer, WAIT).unwrap() {
            let frame = &buffer[..received.len];
            if frame.get(14..14 + payload.len()) == Some(payload) {
                return Some((frame.to_vec(), received));
            }
        }
    }
    None
}

#[test]
fn frames_cross_a_veth_pair_and_an_idle_socket_times_out() {
    if !privileged("frames_cross_a_veth_pair_and_an_idle_socket_times_out") {
        return;
    }
    let pair = Pair::new();
    pair.run(|| {
        let sender = RawSocket::open("veth0").unwrap();
        let sent_copies = RawSocket::open_receiving("veth0", Receive::All).unwrap();
        let receiver =
            RawSocket::open_receiving("veth1", Receive::EtherType(LOCAL_EXPERIMENTAL)).unwrap();
        assert_eq!(receiver.interface(), "veth1");

        // Nothing of this EtherType was sent yet: the wait ends empty.
        let mut buffer = [0u8; 2048];
        assert_eq!(
            receiver
                .receive(&mut buffer, Duration::from_millis(100))
                .unwrap(),
            None
        );

        let sent = frame(b"flatnet raw socket");
        sender.send(&sent).unwrap();
        let (got, received) = wait_for(&receiver, b"flatnet raw socket").expect("frame on veth1");
        assert_eq!(got, sent, "the whole frame, headers included");
        assert!(!received.outgoing, "veth1 received it");
        let (_, copy) = wait_for(&sent_copies, b"flatnet raw socket").expect("copy on veth0");
        assert!(copy.outgoing, "veth0 sent it");

        // A buffer shorter than the frame gets its start.
        sender.send(&frame(b"second")).unwrap();
        let mut short = [0u8; 20];
        let cut = receiver
            .receive(&mut short, WAIT)
            .unwrap()
            .expect("second frame");
        assert_eq!(cut.len, 20);
        assert_eq!(&short[14..20], b"second");
    });
}
