use super::*;

const MAX_MESSAGE_SIZE: usize = 1024;

fn limited_codec() -> ZmqCodec {
    let mut options = SocketOptions::default();
    options.max_message_size(MAX_MESSAGE_SIZE);
    let mut codec = ZmqCodec::with_options(&options);
    codec.state = DecoderState::FrameHeader;
    codec.waiting_for = 1;
    codec
}

fn long_frame_header(flags: u8, len: u64) -> BytesMut {
    let mut input = BytesMut::from(&[flags | 0b0000_0010][..]);
    input.extend_from_slice(&len.to_be_bytes());
    input
}

fn short_frame(more: bool, body: &[u8]) -> Vec<u8> {
    let mut frame = vec![u8::from(more), body.len() as u8];
    frame.extend_from_slice(body);
    frame
}

#[test]
fn max_message_size_refuses_a_huge_claimed_frame_before_reserving_it() {
    for claimed in [1u64 << 40, (MAX_MESSAGE_SIZE + 1) as u64] {
        let mut codec = limited_codec();
        let mut input = long_frame_header(0, claimed);
        let capacity = input.capacity();
        assert!(matches!(
            codec.decode(&mut input),
            Err(CodecError::MessageTooLarge {
                max: MAX_MESSAGE_SIZE,
                ..
            })
        ));
        assert!(input.capacity() <= capacity);
    }
}

#[test]
fn max_message_size_refuses_a_huge_claimed_command_frame() {
    let mut codec = limited_codec();
    let mut input = long_frame_header(0b0000_0100, 1 << 40);
    assert!(matches!(
        codec.decode(&mut input),
        Err(CodecError::MessageTooLarge { .. })
    ));
}

#[test]
fn max_message_size_accepts_a_frame_at_the_limit() {
    let body_len = MAX_MESSAGE_SIZE - FRAME_OVERHEAD;
    let mut codec = limited_codec();
    let mut input = long_frame_header(0, body_len as u64);
    input.resize(input.len() + body_len, 7);
    let Message::Message(message) = codec.decode(&mut input).unwrap().unwrap() else {
        panic!("expected message");
    };
    assert_eq!(message.get(0).map(Bytes::len), Some(body_len));
    assert!(input.is_empty());
}

#[test]
fn max_message_size_counts_every_frame_of_a_multipart_message() {
    let mut codec = limited_codec();
    let body = [7u8; 180];
    let mut input = BytesMut::new();
    // Four frames fit; the fifth would take the message over the limit.
    for _ in 0..4 {
        input.extend_from_slice(&short_frame(true, &body));
    }
    input.extend_from_slice(&short_frame(false, &body));
    assert!(matches!(
        codec.decode(&mut input),
        Err(CodecError::MessageTooLarge { size, max: MAX_MESSAGE_SIZE })
            if size == 5 * (body.len() + FRAME_OVERHEAD)
    ));
}

#[test]
fn max_message_size_bounds_a_message_of_empty_frames() {
    let mut codec = limited_codec();
    let mut input = BytesMut::from([1, 0].repeat(MAX_MESSAGE_SIZE).as_slice());
    assert!(matches!(
        codec.decode(&mut input),
        Err(CodecError::MessageTooLarge { .. })
    ));
}

#[test]
fn max_message_size_applies_to_each_message_not_to_the_stream() {
    let mut codec = limited_codec();
    let body = [7u8; 200];
    let mut input = BytesMut::new();
    for _ in 0..20 {
        input.extend_from_slice(&short_frame(true, &body));
        input.extend_from_slice(&short_frame(false, &body));
    }
    for _ in 0..20 {
        let Message::Message(message) = codec.decode(&mut input).unwrap().unwrap() else {
            panic!("expected message");
        };
        assert_eq!(message.len(), 2);
    }
    assert!(input.is_empty());
}

#[test]
fn no_max_message_size_by_default() {
    let mut codec = ZmqCodec::new();
    codec.state = DecoderState::FrameHeader;
    codec.waiting_for = 1;
    let mut input = long_frame_header(0, 4 * MAX_MESSAGE_SIZE as u64);
    assert!(codec.decode(&mut input).unwrap().is_none());
    input.resize(4 * MAX_MESSAGE_SIZE, 7);
    assert!(codec.decode(&mut input).unwrap().is_some());
}
