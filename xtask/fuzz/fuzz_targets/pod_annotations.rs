//! The pod annotations `subnet`, `ip` and `mac`, one per line. Property:
//! an accepted request, written back in the annotation syntax, parses to
//! the same request.
#![no_main]

use flatnet_k8s::annotations::{PodRequest, parse_macs, parse_pod_request};
use libfuzzer_sys::fuzz_target;

/// The annotation values that express `request`.
fn render(request: &PodRequest) -> [String; 3] {
    let subnet = request
        .subnets
        .iter()
        .map(|s| s.subnet.as_str())
        .collect::<Vec<_>>()
        .join(",");
    let ip = if request.is_auto() {
        "auto".to_owned()
    } else {
        request
            .subnets
            .iter()
            .map(|s| {
                if s.candidates.is_empty() {
                    "auto".to_owned()
                } else {
                    let ips: Vec<String> = s.candidates.iter().map(ToString::to_string).collect();
                    ips.join("-")
                }
            })
            .collect::<Vec<_>>()
            .join(",")
    };
    let mac = request
        .macs
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("-");
    [subnet, ip, mac]
}

fuzz_target!(|data: &[u8]| {
    let Some([subnet, ip, mac]) = flatnet_fuzz::lines::<3>(data) else {
        return;
    };
    if let Ok(macs) = parse_macs(mac) {
        let text: Vec<String> = macs.iter().map(ToString::to_string).collect();
        assert_eq!(parse_macs(&text.join("-")).ok(), Some(macs));
    }
    let Ok(request) = parse_pod_request(subnet, ip, mac) else {
        return;
    };
    let [subnet, ip, mac] = render(&request);
    assert_eq!(
        parse_pod_request(&subnet, &ip, &mac).ok(),
        Some(request),
        "written back as subnet={subnet:?} ip={ip:?} mac={mac:?}"
    );
});
