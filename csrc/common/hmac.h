// SHA-256 (FIPS 180-4) and HMAC-SHA256 (RFC 2104), for the connection handshakes: both ends prove
// they hold the job token by a keyed hash over fresh nonces, so the token never travels.
//
// Written from the standards, small and unoptimised: it hashes a few hundred bytes per connection.
// Also: random bytes from the kernel (getrandom) and a comparison whose time does not depend on
// where two MACs first differ.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

namespace fasthorovod {

constexpr size_t kSha256Bytes = 32;
using Digest = std::array<uint8_t, kSha256Bytes>;

class Sha256 {
 public:
  Sha256();
  void Update(const void* data, size_t len);
  Digest Finish();  // the object must not be updated afterwards

 private:
  void Compress(const uint8_t block[64]);
  uint32_t state_[8];
  uint8_t block_[64];
  size_t block_len_ = 0;
  uint64_t total_bytes_ = 0;
};

Digest Sha256Of(const void* data, size_t len);
Digest HmacSha256(const void* key, size_t key_len, const void* message, size_t message_len);

// True when the n bytes of a and b are equal; takes the same time wherever they differ.
bool ConstantTimeEqual(const void* a, const void* b, size_t n);

// Fills out with n bytes from the kernel's random source (getrandom); false if unavailable.
bool RandomBytes(void* out, size_t n);

}  // namespace fasthorovod
