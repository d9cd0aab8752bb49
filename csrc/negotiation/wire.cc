#include "negotiation/wire.h"

#include "transport/socket.h"

namespace fasthorovod {

Status SendFrame(int fd, const std::string& frame, Deadline deadline, const std::string& who) {
  return SendAll(fd, frame.data(), frame.size(), deadline, who);
}

Status RecvFrame(int fd, Deadline deadline, const std::string& who, MsgType* type, std::string* payload) {
  FrameHead head{};
  FHVD_RETURN_IF_ERROR(RecvAll(fd, &head, sizeof(head), deadline, who));
  if (head.magic != kNegotiationMagic) {
    return Status::Error(Code::kIoError, Str("corrupt negotiation frame from ", who, " (bad magic)"));
  }
  if (head.length > kMaxFrameBytes) {
    return Status::Error(Code::kIoError, Str("negotiation frame from ", who, " too large (", head.length, " bytes)"));
  }
  payload->assign(head.length, '\0');
  FHVD_RETURN_IF_ERROR(RecvAll(fd, payload->data(), head.length, deadline, who));
  *type = static_cast<MsgType>(head.type);
  return Status::Ok();
}

}  // namespace fasthorovod
