// The primitives of the connection handshakes (transport/socket.h): both ends prove they hold the
// job token by an HMAC-SHA256 over fresh nonces, so the token itself never travels, and the
// acceptor compares MACs in time that does not depend on where they first differ.
//
// SHA-256, HMAC-SHA256 and the comparison are OpenSSL's libcrypto; the nonces come from the
// kernel's random source (getrandom).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>

namespace fasthorovod {

constexpr size_t kSha256Bytes = 32;
using Digest = std::array<uint8_t, kSha256Bytes>;

// SHA-256 (FIPS 180-4) of len bytes.
Digest Sha256Of(const void* data, size_t len);

// HMAC-SHA256 (RFC 2104) of the message under the key; a key longer than the 64-byte block is
// hashed first, as the RFC says.
Digest HmacSha256(const void* key, size_t key_len, const void* message, size_t message_len);

// True when the n bytes of a and b are equal; takes the same time wherever they differ.
bool ConstantTimeEqual(const void* a, const void* b, size_t n);

// Fills out with n bytes from the kernel's random source (getrandom); false if unavailable.
bool RandomBytes(void* out, size_t n);

}  // namespace fasthorovod
